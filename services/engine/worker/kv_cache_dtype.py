"""The KV cache's dtype: the model's, or float16 under a float32 model on CPU.

A float32 model (a GGUF file's default: its blocks are dequantized into float32 arithmetic)
with a float32 cache reads 4 bytes per cached key and value element in every decode step
and holds half the tokens that a float16 cache would in the same memory; llama.cpp keeps
its cache in float16 by default, and so does `auto` for a GGUF file on CPU. The CPU
attention kernels read a float16 cache into float32 arithmetic (F16C conversions), the
cache writes round to it once. On SmolLM2-135M-Instruct Q4_1 that moved one of 1280
teacher-forced top-1 picks against transformers (a near tie; 1.0000 -> 0.9992), 0.9750 ->
0.9758 against llama.cpp, and left the perplexity gap to llama.cpp at -0.51%
(tests/unit/engine/models/test_gguf_vs_llama_cpp.py).
"""

from __future__ import annotations

import torch
from corestream_kernels.cpu_extension import cache_dtype_supported

from services.engine.worker.config import KV_CACHE_DTYPES


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                   gguf: bool = False) -> torch.dtype:
    """`--kv-cache-dtype` resolved for a model of `model_dtype` (a GGUF file's if `gguf`) on
    `device`; ValueError for a pair the kernels do not serve."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    def served(dtype: torch.dtype) -> bool:  # a mixed pair only where the CPU kernels run
        return dtype == model_dtype or (
            device.type == "cpu" and cache_dtype_supported(model_dtype, dtype))

    if name == "auto":
        return torch.float16 if gguf and served(torch.float16) else model_dtype
    dtype = getattr(torch, name)
    if served(dtype):
        return dtype
    model = str(model_dtype).removeprefix("torch.")
    raise ValueError(f"kv_cache_dtype {name} is not served under a {model} model on "
                     f"{device.type}: use auto (the model's dtype), or float16 under a "
                     f"float32 model on CPU")
