"""EngineConfig: the engine-core's own settings (the model runner has RunnerConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import doc
from services.common.weight_version import check_weight_version
from services.engine.speculative.config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class EngineConfig:
    host: str = doc("Interface the EngineCoreService binds to.", default="127.0.0.1")
    port: int = doc("Port of the EngineCoreService; 0 picks any free port.", default=0)
    engine_index: int = doc("Data-parallel rank of this engine.", default=0)
    coordinator: str = doc(
        "host:port of the DP coordinator to register with; empty runs standalone.", default=""
    )
    advertise_address: str = doc(
        "Address registered with the coordinator; empty means host:bound port.", default=""
    )
    max_num_seqs: int = doc("Most requests running in one step.", default=128)
    max_num_batched_tokens: int = doc(
        "Token budget of one step (prefill chunks plus decodes).", default=2048
    )
    scheduling_policy: str = doc(
        "Order of admission: fcfs (arrival) or priority (lower value first).", default="fcfs"
    )
    max_concurrent_batches: int = doc(
        "Depth of the batch queue: with 2 the next step is scheduled while the previous one "
        "executes; 1 runs schedule, execute, update one after another.", default=1
    )
    weight_version: str = doc(
        "Version of the weights served at start, stamped on every output; each live weight "
        "update sets a new one.", default="0"
    )
    profile_dir: str = doc(
        "Folder where the profile utility call writes torch profiler traces; empty means "
        "a folder under the system temp dir.", default=""
    )
    max_waiting_requests: int = doc(
        "Most requests that may wait for admission; past it new requests are refused at "
        "once with RESOURCE_EXHAUSTED (a retry hint goes to the client), so the queue, and "
        "the memory and latency behind it, stay bounded.", default=1024
    )
    grammar_compile_timeout_s: float = doc(
        "Seconds an output constraint may take to compile; past it the request fails with "
        "INVALID_ARGUMENT and no tokens (the others are unaffected).", default=30.0
    )
    grammar_compile_workers: int = doc(
        "Threads that compile output constraints off the busy loop.", default=2
    )
    grammar_cache_size: int = doc(
        "Compiled output constraints kept for reuse (least recently used dropped first).",
        default=256
    )
    iteration_details: bool = doc(
        "Record what every step did (requests and tokens, prefill and decode counts, "
        "seconds in schedule, forward, sample and update): histograms in the metrics and "
        "the latest steps in the stats (`corestream admin stats`). Off, they cost nothing; "
        "a Session can still ask for them in its hello.", default=False
    )
    onednn_warmup: bool = doc(
        "On CPU, build oneDNN's matmul primitives for every row bucket up to "
        "max_num_batched_tokens at start (about a second and 0.6 MiB each on the tiny "
        "model: ~140 MiB): the engine's memory then stays flat after start, and no request "
        "waits ~5 ms per layer shape for a length the engine has not seen.", default=True
    )
    max_step_faults: int = doc(
        "Steps that may fail in a row (an exception in the forward, or a collective of "
        "the expert-parallel group whose peer died or froze) before the engine dies. Each "
        "failure pauses the engine (PAUSED_FAULT) with its weights, KV cache and requests, "
        "re-forms its group, and reruns the step; 0 dies at the first.", default=3
    )
    engine_recovery_timeout_s: float = doc(
        "Seconds a paused engine waits for the missing ranks of its group to come back "
        "(or be replaced); past them the ranks that are back go on as a smaller group if "
        "they can hold every expert (else they wait on, saying why), and a rank that "
        "cannot reach its group's store gives up and dies, its requests ending with "
        "UNAVAILABLE.", default=120.0
    )
    speculative_config: str = doc(
        "Speculative decoding, as a JSON object in vLLM's shape: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} "
        "or {\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4} "
        "(optional: disable_by_batch_size, default 4; min_acceptance_rate, default 0.3). "
        "Empty: off.", default=""
    )
    log_level: str = doc("Log level: debug, info, warning, error.", default="info")
    shutdown_timeout: float = doc(
        "Seconds that in-flight requests get to finish after SIGTERM before they are aborted "
        "with UNAVAILABLE; 0 aborts them at once.", default=30.0
    )
    watchdog_timeout: float = doc(
        "Seconds a busy-loop iteration may take while work is pending before the engine dumps "
        "every thread's stack, declares itself DEAD and exits non-zero; 0 disables it. An idle "
        "engine never trips it.", default=120.0
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.engine_index < 0:
            raise ValueError(f"engine_index must be >= 0, got {self.engine_index}")
        check_weight_version(self.weight_version, "weight_version")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_waiting_requests < 1:
            raise ValueError(
                f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}"
            )
        if not 1 <= self.max_concurrent_batches <= 8:
            raise ValueError(
                f"max_concurrent_batches must be in [1, 8], got {self.max_concurrent_batches}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        SpeculativeConfig.parse(self.speculative_config)  # raises naming the key at fault
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not (0 < self.grammar_compile_timeout_s < math.inf):
            raise ValueError("grammar_compile_timeout_s must be a finite number > 0, "
                             f"got {self.grammar_compile_timeout_s}")
        for name, low, high in (("grammar_compile_workers", 1, 64),
                                ("grammar_cache_size", 1, 1 << 20)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
        if not 0 <= self.max_step_faults <= 1000:
            raise ValueError(f"max_step_faults must be in [0, 1000], got {self.max_step_faults}")
        if not (0 < self.engine_recovery_timeout_s < math.inf):
            raise ValueError("engine_recovery_timeout_s must be a finite number > 0, "
                             f"got {self.engine_recovery_timeout_s}")
        for name in ("shutdown_timeout", "watchdog_timeout"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("coordinator", "advertise_address"):
            value = getattr(self, name)
            if value and ":" not in value:
                raise ValueError(f"{name} must be host:port, got {value!r}")
