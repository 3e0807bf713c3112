"""RunnerConfig: what the model runner loads and how much memory its KV cache gets."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import doc

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
MiB = 1 << 20


@dataclass(frozen=True)
class RunnerConfig:
    model: str = doc(
        "Hugging Face checkpoint folder; empty uses the built-in tiny random Llama.", default=""
    )
    dtype: str = doc(
        "Weight and activation dtype: auto (the checkpoint's), float32, bfloat16, float16.",
        default="auto",
    )
    device: str = doc("auto (cuda when present, else cpu), cpu or cuda.", default="auto")
    block_size: int = doc("Tokens per KV-cache block.", default=16)
    kv_cache_memory: int = doc("Bytes given to the KV cache.", default=256 * MiB)
    max_model_len: int = doc(
        "Longest sequence (prompt + output) in tokens; 0 takes the checkpoint's.", default=0
    )
    seed: int = doc("Seed of the generator that requests without their own seed use.", default=0)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.max_model_len < 0:
            raise ValueError(
                f"max_model_len must be >= 0 (0 = the checkpoint's), got {self.max_model_len}"
            )
