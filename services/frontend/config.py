"""Configuration of the frontend process (each field is a `corestream frontend` flag)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import doc
from services.common.grpc_server import SESSION_HEARTBEAT_S, MiB
from services.frontend.chat.parsers.reasoning import REASONING_PARSERS
from services.frontend.chat.parsers.tools import TOOL_PARSERS
from services.frontend.generate.validation import (
    MAX_SAMPLES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from services.frontend.routing.policies import RoutingPolicy

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
_ROUTING_POLICIES = tuple(p.value for p in RoutingPolicy)
TOOL_CALL_PARSER_CHOICES = ("auto", "none", *sorted(TOOL_PARSERS))


def _check_address(name: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be HOST:PORT, got {address!r}")


@dataclass(frozen=True)
class FrontendConfig:
    host: str = doc("Address to listen on.", default="127.0.0.1")
    port: int = doc("Port of the public GenerateService.", default=50051)
    http_port: int = doc(
        "Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health) on the same host; -1 turns it off, 0 picks a free port.",
        default=-1,
    )
    http_header_timeout_s: float = doc(
        "HTTP door: seconds a connection may take to send a request's headers (from its "
        "opening, or from the previous response); past it, 408 and the connection closes. "
        "Bounds idle and slowloris connections.", default=10.0
    )
    http_body_timeout_s: float = doc(
        "HTTP door: seconds a request's body may take to arrive after its headers; past "
        "it, 408.", default=60.0
    )
    http_write_timeout_s: float = doc(
        "HTTP door: seconds a response may stay blocked on a client that does not read "
        "(its socket buffer full); past it, the connection is dropped and the request "
        "aborted, as for a client that left.", default=60.0
    )
    http_keep_alive_s: float = doc(
        "HTTP door: seconds an idle kept-alive connection stays open after a response.",
        default=5.0
    )
    http_max_connections: int = doc(
        "HTTP door: most open connections; one more gets a 503 and is closed.", default=4096
    )
    vllm_grpc: bool = doc(
        "Also serve vLLM's gRPC engine API (vllm.grpc.engine.VllmEngine, as the smg "
        "gateway calls vLLM workers) on the gRPC port. While on, every engine publishes "
        "its prefix-cache events to this frontend for SubscribeKvEvents, whatever the "
        "routing policy.", default=True
    )
    coordinator: str = doc(
        "HOST:PORT of the DP coordinator; engines are learned from its WatchLoad stream.",
        default="",
    )
    engines: tuple[str, ...] = doc(
        "Static engine addresses (HOST:PORT), used when no coordinator is given.",
        default=(),
    )
    model: str = doc(
        "Checkpoint directory whose tokenizer and config are served; empty means the "
        "built-in tiny checkpoint.",
        default="",
    )
    served_model_name: str = doc(
        "Model name reported to clients; empty means the checkpoint's name.", default=""
    )
    routing_policy: str = doc(
        "How requests are spread over the engines: cache_aware (to the engine whose prefix "
        "cache holds most of the prompt, weighed against its load; engines publish their "
        "cache on the Session), least_load, or round_robin. A request's "
        "data_parallel_rank always wins.", default="cache_aware"
    )
    prefill_tokens_per_request: float = doc(
        "cache_aware: uncached prompt tokens that weigh as much as one more request on "
        "an engine; lower values follow cached prefixes harder.", default=64.0
    )
    prefix_index_max_blocks: int = doc(
        "cache_aware: most block hashes the routing index keeps (about 200 bytes each); "
        "past it the least recently used are forgotten.", default=1 << 20
    )
    max_prompt_tokens: int = doc(
        "Longest accepted prompt in tokens; 0 means the model's context length.", default=0
    )
    request_timeout_s: float = doc(
        "Server-side limit on one request's lifetime, in seconds.", default=600.0
    )
    log_level: str = doc(f"One of {', '.join(_LOG_LEVELS)}.", default="info")
    event_loop: str = doc(
        "The event loop the gRPC and HTTP servers run on: uvloop (libuv; about a fifth "
        "less CPU per streamed token, CPU a single machine's engines would otherwise "
        "lose), asyncio (the standard library's), or auto (uvloop where installed).",
        default="auto"
    )
    shutdown_timeout: float = doc(
        "Seconds that running requests get to finish after SIGTERM (new ones are refused with "
        "UNAVAILABLE) before they end with UNAVAILABLE; 0 ends them at once.", default=30.0
    )
    watchdog_timeout: float = doc(
        "Treat an engine as dead when its Session stays silent this many seconds while "
        "requests are in flight there (engines send a heartbeat every "
        f"{SESSION_HEARTBEAT_S:g} s, so only a frozen process trips it); 0 disables it.",
        default=120.0,
    )

    vllm_metric_names: bool = doc(
        "Also export the load an endpoint picker reads (the engines' totals: "
        "corestream:server_num_requests_waiting, _running, _kv_cache_usage_perc, "
        "_cache_config_info) under vLLM's names (vllm:num_requests_waiting, ..., "
        "vllm:gpu_cache_usage_perc, vllm:cache_config_info), so that pickers set up for "
        "vLLM (the Gateway API Inference Extension's EPP, llm-d, SGLang's gateway) read "
        "this server unchanged.", default=False
    )

    restart_status_file: str = doc(
        "Set by `corestream serve`: its JSON record of restarted processes, reported by "
        "AdminService/GetEngineStats. Empty: not started by serve.", default=""
    )

    api_key_file: str = doc(
        "File of API keys, one per line (blank lines and # comments ignored); when set, "
        "every RPC but health needs 'authorization: Bearer <key>' metadata, else "
        "UNAUTHENTICATED. Empty: no client auth.", default=""
    )
    admin_api_key_file: str = doc(
        "File of admin keys (same format); when set, AdminService RPCs need one of these "
        "(an API key gets PERMISSION_DENIED). Admin keys are also accepted as API keys.",
        default=""
    )
    max_message_bytes: int = doc(
        "Largest request message accepted, in bytes; bigger ones get RESOURCE_EXHAUSTED "
        "before they are parsed.", default=16 * MiB
    )
    max_tokens_limit: int = doc(
        "Largest sampling.max_tokens accepted (and the default when unset); 0 means the "
        "model's context length.", default=0
    )
    max_n: int = doc("Largest sampling.n (samples per request) accepted.", default=MAX_SAMPLES)
    max_pooling_inputs: int = doc(
        "Most inputs in one pooling call (PoolingService, /v1/embeddings, /v1/score, "
        "/v1/rerank, /classify).", default=2048)
    max_stop_strings: int = doc(
        "Most sampling.stop strings one request may give.", default=MAX_STOP_STRINGS
    )
    max_stop_string_length: int = doc(
        "Longest sampling.stop string accepted, in characters.", default=MAX_STOP_STRING_CHARS
    )
    max_constraint_chars: int = doc(
        "Largest output constraint accepted (sampling.json_schema, regex, grammar, or the "
        "choices together), in characters. The default admits real schemas (a bundled "
        "Kubernetes PodList is 249k characters and compiles in about 0.25 s); the "
        "engines' grammar_compile_timeout_s and grammar_cache_size bound what a large "
        "one costs.", default=1 << 20
    )
    strict_json_schema: bool = doc(
        "Refuse a JSON Schema that the grammar can only approximate (a oneOf whose "
        "branches are not provably disjoint, a keyword such as not, if or uniqueItems) "
        "instead of serving it with the output validated after generation "
        "(FINISH_REASON_SCHEMA_MISMATCH when it fails).", default=False
    )
    chat_template: str = doc(
        "Jinja chat template file for ChatService, replacing the checkpoint's own "
        "(chat_template.jinja or tokenizer_config.json's chat_template). Empty: the "
        "checkpoint's.", default=""
    )
    trust_request_chat_template: bool = doc(
        "Accept a chat template sent in a request (chat_template field). Templates are "
        "code, run in a sandbox; off by default.", default=False
    )
    chat_template_render_timeout_s: float = doc(
        "Longest a chat template may take to render one conversation, in seconds; past "
        "it the request fails with INVALID_ARGUMENT. Rendered output (and every string a "
        "template builds) is also held to 8 x max_chat_chars characters.", default=2.0
    )
    tool_call_parser: str = doc(
        "How tool calls are read out of answers: hermes, llama3_json, mistral, auto (picked "
        "from the chat template) or none (answers are content only).", default="auto"
    )
    reasoning_parser: str = doc(
        "How reasoning is split from the answer: deepseek_r1, qwen3, or empty for none.",
        default=""
    )
    max_chat_messages: int = doc(
        "Most messages in one chat request.", default=1024
    )
    max_chat_chars: int = doc(
        "Largest chat request, in characters of its messages and tool definitions "
        "together (the rendered prompt is also held to max_prompt_tokens).", default=1 << 20
    )
    max_concurrent_streams: int = doc(
        "Most concurrent calls on one client connection (HTTP/2 streams). A gRPC client "
        "queues calls beyond it once it has the server's settings; calls it opens before "
        "that are refused unstarted (REFUSED_STREAM: UNAVAILABLE, safe to retry), so keep "
        "it above a client's usual burst.", default=1024
    )

    def __post_init__(self) -> None:
        if self.routing_policy not in _ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(_ROUTING_POLICIES)}, "
                             f"got {self.routing_policy!r}")
        if not (self.prefill_tokens_per_request > 0
                and math.isfinite(self.prefill_tokens_per_request)):
            raise ValueError("prefill_tokens_per_request must be > 0, got "
                             f"{self.prefill_tokens_per_request}")
        if self.prefix_index_max_blocks < 1:
            raise ValueError("prefix_index_max_blocks must be >= 1, got "
                             f"{self.prefix_index_max_blocks}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"http_port must be -1 (off) or in [0, 65535], got {self.http_port}")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_write_timeout_s",
                     "http_keep_alive_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 1 <= self.http_max_connections <= 1 << 20:
            raise ValueError(f"http_max_connections must be in [1, {1 << 20}], got "
                             f"{self.http_max_connections}")
        if self.coordinator:
            _check_address("coordinator", self.coordinator)
        for address in self.engines:
            _check_address("engines", address)
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not (0 < self.chat_template_render_timeout_s <= 3600):
            raise ValueError("chat_template_render_timeout_s must be in (0, 3600], got "
                             f"{self.chat_template_render_timeout_s}")
        if not (0 <= self.shutdown_timeout < math.inf):
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        min_watchdog_s = 3 * SESSION_HEARTBEAT_S
        if self.watchdog_timeout != 0 and not (min_watchdog_s <= self.watchdog_timeout < math.inf):
            raise ValueError(
                f"watchdog_timeout must be 0 (off) or >= {min_watchdog_s:g} s (three engine "
                f"heartbeats), got {self.watchdog_timeout}"
            )
        if not 4096 <= self.max_message_bytes <= 1024 * MiB:
            raise ValueError(
                f"max_message_bytes must be in [4096, {1024 * MiB}], got {self.max_message_bytes}"
            )
        for name, low, high in (("max_tokens_limit", 0, 1 << 30), ("max_n", 1, 1024),
                                ("max_stop_strings", 0, 1024),
                                ("max_stop_string_length", 1, 1 << 16),
                                ("max_constraint_chars", 1, 1 << 24),
                                ("max_chat_messages", 1, 1 << 20),
                                ("max_chat_chars", 1, 1 << 28),
                                ("max_concurrent_streams", 1, 1 << 16)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
        if self.tool_call_parser not in TOOL_CALL_PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSER_CHOICES}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {tuple(REASONING_PARSERS)} or "
                             f"empty, got {self.reasoning_parser!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {EVENT_LOOPS}, got {self.event_loop!r}")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
