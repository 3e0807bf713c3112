"""KvEventsConfig: where an engine publishes its KV-cache events in vLLM's format."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import doc

SCHEMES = ("tcp://", "ipc://", "inproc://")
FORMATS = ("vllm", "array")


@dataclass(frozen=True)
class KvEventsConfig:
    kv_events_endpoint: str = doc(
        "Publish KV-cache events in vLLM's format on this ZeroMQ PUB endpoint "
        "(tcp://HOST:PORT, ipc://PATH); empty: off. As vLLM does, a wildcard host "
        "(tcp://*:5557) or ipc:// binds; any other address connects (llm-d's indexer "
        "binds and the engines dial it). Engine N uses port + N (see "
        "kv_events_offset_ports).", default=""
    )
    kv_events_replay_endpoint: str = doc(
        "A ZeroMQ ROUTER endpoint (bound) that resends the buffered batches from a given "
        "sequence number, for a subscriber that missed some; empty: no replay. Engine N "
        "uses port + N (see kv_events_offset_ports).", default=""
    )
    kv_events_offset_ports: bool = doc(
        "Engine N publishes and replays on port + N (ipc paths and inproc names get a "
        "_dpN suffix), as vLLM's data-parallel ranks do, so that engines sharing a host "
        "(`corestream serve --engines N`) can share the flags; off where every engine has "
        "an address of its own (one Kubernetes pod each).", default=True
    )
    kv_events_topic: str = doc(
        "The topic frame of every message, as llm-d's `kv@POD_IP@MODEL`.", default=""
    )
    kv_events_format: str = doc(
        "The events' layout: vllm (maps with a type tag and sha256 hashes as bytes, as "
        "vLLM 0.32 sends) or array (tagged arrays with 64-bit integer hashes, the layout "
        "of earlier vLLM releases that llm-d's indexer decodes).", default="vllm"
    )
    kv_events_buffer_steps: int = doc(
        "Batches (one per engine step that changed the cache) kept for replay.",
        default=10_000
    )

    def __post_init__(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(SCHEMES):
                raise ValueError(f"{name} must start with one of {', '.join(SCHEMES)}, "
                                 f"got {value!r}")
            if value.startswith("tcp://"):
                _, _, port = value.rpartition(":")
                if not port.isdigit() or not 0 < int(port) <= 65535:
                    raise ValueError(f"{name} must end with :PORT (1-65535), got {value!r}")
        if self.kv_events_format not in FORMATS:
            raise ValueError(f"kv_events_format must be one of {', '.join(FORMATS)}, "
                             f"got {self.kv_events_format!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if not 1 <= self.kv_events_buffer_steps <= 10_000_000:
            raise ValueError("kv_events_buffer_steps must be in [1, 10000000], "
                             f"got {self.kv_events_buffer_steps}")

    @property
    def enabled(self) -> bool:
        return bool(self.kv_events_endpoint)


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's convention, so that one flag serves every data-parallel engine: a TCP
    port moves up by the rank, an inproc name gets a suffix, an ipc path is shared
    only by rank 0 (later ranks get a suffix too)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """Whether a PUB endpoint is ours to bind (else we connect to a subscriber's)."""
    return not endpoint.startswith("tcp://") or "*" in endpoint or "::" in endpoint
