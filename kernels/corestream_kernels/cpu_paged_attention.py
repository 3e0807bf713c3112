"""The C++ attention kernels for CPU: decodes (`csrc/paged_attention_cpu.cpp`) and
prefills (`csrc/paged_prefill_cpu.cpp`).

The torch path gathers every sequence's K and V blocks into dense tensors and then runs
SDPA over them, so it reads the context twice and writes it once, and runs prompts one
per call; the kernels read each cached token in place, the whole batch in one parallel
region. They are part of the CPU extension that `corestream_kernels.cpu_extension` builds
on first use; where that build fails the caller gets None and uses torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from corestream_kernels.cpu_extension import DTYPES, cache_dtype_supported, cpu_ops, load

# Mirror the C++ entry point's limits, so unsupported shapes take the torch path
# instead of raising.
_MAX_HEAD_DIM = 256
_MAX_HEADS = 256

# paged_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window):
# window is the sliding window in tokens, 0 for none.
DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
     float, int],
    None,
]
# paged_prefill(out, query, key_cache, value_cache, block_tables, seq_lens,
# query_start_loc, scale, window): writes the rows of every sequence with two or more
# query rows, and leaves the others' rows as they are.
PrefillFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
     torch.Tensor, float, int],
    None,
]


def decode_shape_supported(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether `paged_decode` takes attention of this dtype and head layout."""
    return _layout_supported(dtype, num_heads, num_kv_heads, head_dim) and num_heads <= _MAX_HEADS


def cpu_decode_kernel(query: torch.Tensor, key_cache: torch.Tensor) -> DecodeFn | None:
    """The kernel's `paged_decode` if it applies to these tensors and builds, else None."""
    ops = _ops_for(query, key_cache) if query.shape[1] <= _MAX_HEADS else None
    return None if ops is None else ops.paged_decode


def cpu_prefill_kernel(query: torch.Tensor, key_cache: torch.Tensor) -> PrefillFn | None:
    """The kernel's `paged_prefill` if it applies to these tensors and builds, else None."""
    ops = _ops_for(query, key_cache)
    return None if ops is None else ops.paged_prefill


def _layout_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> bool:
    return dtype in DTYPES and head_dim <= _MAX_HEAD_DIM and num_heads % num_kv_heads == 0


def _ops_for(query: torch.Tensor, key_cache: torch.Tensor) -> Any:
    """The extension's ops where both kernels' common limits allow these tensors and it
    builds; else None."""
    supported = (
        _layout_supported(query.dtype, query.shape[1], key_cache.shape[2], query.shape[2])
        and cache_dtype_supported(query.dtype, key_cache.dtype)
        and key_cache.is_contiguous()
        and query.stride(-1) == 1
    )
    return cpu_ops(query) if supported else None


def warm_up() -> DecodeFn | None:
    """Build or load the CPU extension; its `paged_decode`, or None if it cannot be built."""
    ops = load()
    return None if ops is None else ops.paged_decode
