"""RunnerConfig: what the model runner loads and how much memory its KV cache gets."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import doc
from services.engine.worker.kv_cache_memory import EXAMPLES, KVCacheMemory

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RunnerConfig:
    model: str = doc(
        "Hugging Face checkpoint folder; empty uses the built-in tiny random Llama.", default=""
    )
    dtype: str = doc(
        "Weight and activation dtype: auto (the checkpoint's), float32, bfloat16, float16.",
        default="auto",
    )
    kv_cache_dtype: str = doc(
        "Dtype of the KV cache: auto (the model's dtype; float16 for a GGUF file served in "
        "float32 on CPU, as llama.cpp keeps it), the model's dtype, or float16 under a "
        "float32 model on CPU (half the cache's memory and of the bytes attention reads per "
        "token; keys and values rounded to 11 significant bits).",
        default="auto",
    )
    quantization: str = doc(
        "Quantize a safetensors checkpoint's linear weights at load: none, or int8 "
        "(weight-only, one scale per output channel; decode reads a quarter of float32's "
        "bytes). A GGUF file keeps its own quantization.", default="none"
    )
    device: str = doc(
        "auto (cuda when present, else cpu), cpu, cuda, or cuda:K (CUDA device K; with "
        "tensor parallelism, ranks take devices K..K+N-1).", default="auto"
    )
    cpu_set: str = doc(
        "CPUs the engine runs on, as a Linux CPU list such as 0-3,8 (tensor-parallel ranks "
        "split them); empty keeps the CPUs it was started with. serve --engines N gives "
        "each engine its own share.", default=""
    )
    block_size: int = doc("Tokens per KV-cache block.", default=16)
    kv_cache_memory: str = doc(
        f"Memory for the KV cache: {EXAMPLES}; a fraction is of the device memory free "
        "after loading the weights (on CPU: MemAvailable, capped by the memory cgroup's limit).",
        default="auto",
    )
    max_model_len: int = doc(
        "Longest sequence (prompt + output) in tokens; 0 takes the checkpoint's.", default=0
    )
    max_num_seqs: int = doc(
        "Most requests running in one step (the engine's flag of the same name, read here "
        "too: a pooling model's auto KV cache holds at most that many max_model_len "
        "prompts).", default=128
    )
    seed: int = doc("Seed of the generator that requests without their own seed use.", default=0)
    num_threads: int = doc(
        "Threads of the model's CPU operators (torch's intra-op pool); 0 = one per CPU this "
        "process may use: its CPU affinity, capped by a cgroup CPU quota such as a "
        "Kubernetes CPU limit (or OMP_NUM_THREADS when set). serve --engines N gives each "
        "engine its share.", default=0
    )
    huge_pages: bool = doc(
        "On CPU, move the loaded weights onto transparent huge pages (Linux 6.1+, in "
        "place, on a thread of its own while the engine serves): a decode step streams "
        "every weight once, and with 2 MiB pages instead of 4 KiB it does so 5 to 15 "
        "percent faster. No effect where THP is off.", default=True
    )
    tensor_parallel_size: int = doc(
        "Ranks the model is split over (tensor parallelism): each holds 1/N of the weights "
        "and of every KV block, on its own CUDA device or its own share of the CPUs. "
        "1 runs the model in the engine process; N > 1 adds N-1 worker processes.",
        default=1,
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.quantization != "none" and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization {self.quantization} is not served with tensor "
                             f"parallelism (tensor_parallel_size "
                             f"{self.tensor_parallel_size}); pass one or the other")
        index = self.device.removeprefix("cuda:")
        if self.device not in DEVICES and not (index.isdigit() and index != self.device):
            raise ValueError(f"device must be one of {DEVICES} or cuda:K, got {self.device!r}")
        try:
            parse_cpu_list(self.cpu_set)
        except ValueError as exc:
            raise ValueError(f"cpu_set {exc}") from None
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        try:
            KVCacheMemory.parse(self.kv_cache_memory)
        except ValueError as exc:
            raise ValueError(f"kv_cache_memory {exc}") from None
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = one per usable CPU), got "
                             f"{self.num_threads}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in [1, 64], got "
                             f"{self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 0:
            raise ValueError(
                f"max_model_len must be >= 0 (0 = the checkpoint's), got {self.max_model_len}"
            )

    @property
    def cpus(self) -> tuple[int, ...]:
        """cpu_set parsed; () when empty."""
        return parse_cpu_list(self.cpu_set)

    @property
    def kv_cache_budget(self) -> KVCacheMemory:
        """kv_cache_memory parsed (an int, as older callers pass, also parses as bytes)."""
        return KVCacheMemory.parse(self.kv_cache_memory)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-3,8" -> (0, 1, 2, 3, 8), sorted, without repeats; "" -> ()."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (
                last and int(last) < int(first)):
            raise ValueError(f"must be a CPU list like 0-3,8; got {text!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8": what parse_cpu_list reads."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
