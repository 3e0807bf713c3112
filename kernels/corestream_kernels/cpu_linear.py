"""Linear layers on CPU through oneDNN, with each weight reordered once, at load.

`F.linear` on CPU sends float32 to MKL's sgemm, whose fast paths are Intel's: on an AMD
EPYC (AVX-512, no AMX) it reached 14-127 GFLOP/s on a small Llama's projections, where
oneDNN's matmul on a weight already in its blocked layout reached 21-180, 1.4-3x
faster at 1-2048 rows. bfloat16 already runs on oneDNN through `F.linear`, but
reorders the weight on every call; packed once it is 1.1-2x faster at decode batch
sizes (whole steps: benchmarks/cpu_linear.py). So the model's linear weights are packed
at load (`pack_weight`), and every linear layer, the C++ decode op's included, calls
`linear`, which takes either kind of weight.

A packed weight is an opaque oneDNN tensor: it keeps its shape and dtype but has no
strides or storage, so only `linear` may read it.

oneDNN packs bfloat16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere
(AVX2 machines: Zen 3, Haswell to Ice Lake clients) it refuses, and torch's own bfloat16
GEMM runs there at about a fifth of float32's speed. On AVX-512 without the bf16 dot
products it packs bfloat16 in a layout of its own, converting on every call. In both
cases `own_panels` lays the weight out as panels itself, the layer keeps no other copy
(`panels_only_weight`), and the C++ kernel takes every call, prefill's many rows too,
converting bf16 to float32 in registers (`cpu_layout` chooses).

At one to a few rows (decode steps), a linear layer is a pass over its weight, and
oneDNN streamed a packed weight at one row at about half the machine's read bandwidth
(13-17 of 28-31 GB/s). The C++ kernel `panel_linear` (csrc/linear_cpu.cpp) streams the
same bytes at 23-32 GB/s, with no second copy: `weight_panels` gives a plain tensor
that aliases the packed weight's buffer, once its layout is checked against the weight,
and `linear` hands it the calls with few enough rows.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from corestream_kernels.cpu_extension import cpu_ops

PACKED_DTYPES = (torch.float32, torch.bfloat16)

PANEL_WIDTH = 64
"""Output features per panel of a packed weight (csrc/linear_cpu.cpp)."""


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 here (it asks the CPU, capped by ONEDNN_MAX_CPU_ISA)."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` `[out, in]` is a CPU weight oneDNN can take packed."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACKED_DTYPES
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
        and (weight.dtype != torch.bfloat16 or onednn_bf16())
    )


def own_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` `[out, in]` laid out as the panels `panel_linear` reads, by us rather than
    by oneDNN; None where the C++ kernel does not run here for its dtype."""
    ops = cpu_ops(weight)
    if weight.dim() != 2 or ops is None or not ops.panel_linear_supported(weight.dtype):
        return None
    out_features, in_features = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    num_panels = -(-out_features // PANEL_WIDTH)
    rows = -(-in_features // pair)
    panels = _padded(weight, num_panels * PANEL_WIDTH, rows * pair).view(
        num_panels, PANEL_WIDTH, rows, pair).transpose(1, 2).contiguous()
    return panels if pair == 2 else panels.squeeze(3)


def _padded(weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`weight` zero-padded to `[out_features, in_features]`; itself when it has that
    shape already (most do: a copy of a 100 MB head costs as much as its layout)."""
    if tuple(weight.shape) == (out_features, in_features) and weight.is_contiguous():
        return weight
    padded = weight.new_zeros(out_features, in_features)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    return padded


def panels_only_weight(weight: torch.Tensor) -> torch.Tensor:
    """A stand-in for `weight` whose values live only in its panels (`own_panels`): its
    shape and dtype, every stride zero, one element behind it. `linear` and the C++ ops
    read the panels instead, for every call."""
    return torch.zeros((), dtype=weight.dtype).expand(weight.shape)


def is_panels_only(weight: torch.Tensor) -> bool:
    return (not weight.is_mkldnn and weight.dim() == 2 and weight.numel() > 1
            and weight.stride() == (0, 0))


def unpack_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The plain `[out, in]` weight of `panels` (`own_panels` or `weight_panels`)."""
    # [P, Kp, 64] or bfloat16's [P, Kp/2, 64, 2] -> [P, 64, Kp(/2)(, 2)] -> [P * 64, Kp]
    plain = panels.transpose(1, 2).reshape(panels.size(0) * PANEL_WIDTH, -1)
    return plain[:out_features, :in_features]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` in oneDNN's blocked layout for any number of input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def weight_panels(weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """The bytes of `packed` (`pack_weight(weight)`) as the panels `panel_linear` reads,
    `[P, Kp, 64]` (float32) or `[P, Kp / 2, 64, 2]` (bfloat16), with P = ceil(out / 64);
    None if they are laid out otherwise, or the C++ kernel does not run here.

    The result aliases `packed`'s buffer and keeps `packed` alive. oneDNN picks the
    layout by CPU, dtype and shape, so it is compared here with `weight`, in full.
    """
    ops = cpu_ops(weight)
    if ops is None or not packed.is_mkldnn or not ops.panel_linear_supported(weight.dtype):
        return None
    out_features, in_features = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    num_panels = -(-out_features // PANEL_WIDTH)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    panel_bytes = num_panels * PANEL_WIDTH * pair * weight.element_size()
    if nbytes == 0 or nbytes % panel_bytes:
        return None
    rows = nbytes // panel_bytes  # Kp / pair
    if rows * pair < in_features:
        return None
    buffer = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.packed = packed  # the alias must not outlive the buffer
    flat = torch.frombuffer(buffer, dtype=weight.dtype)
    shape = (num_panels, rows, PANEL_WIDTH) + ((pair,) if pair > 1 else ())
    panels = flat.view(shape)
    expected = _padded(weight, num_panels * PANEL_WIDTH, rows * pair).view(
        num_panels, PANEL_WIDTH, rows, pair).transpose(1, 2)
    # Bit for bit: a NaN in the weight (NaN != NaN) must not cost the layer its panels.
    bits = torch.int32 if weight.element_size() == 4 else torch.int16
    same = torch.equal(panels.view(bits), expected.reshape(shape).view(bits))
    return panels if same else None


def layout_name(stored: torch.Tensor, panels: torch.Tensor | None) -> str:
    """What `cpu_layout` made of a weight, in words, for the load log."""
    if is_panels_only(stored):
        return "C++ panels for every call"
    if stored.is_mkldnn:
        return "oneDNN packed" + (" + C++ panels for decode rows" if panels is not None else "")
    return "torch (F.linear)"


def why_no_onednn(dtype: torch.dtype) -> str:
    """Why oneDNN does not take `dtype` here (empty where it does)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.bfloat16 and not onednn_bf16():
        return ("oneDNN bf16 unavailable on this CPU (no avx512bw/avx512vl/avx512dq or "
                "avx_ne_convert); bf16 is converted to fp32 in registers")
    return ""


def cpu_layout(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`weight` `[out, in]` as a CPU linear layer holds it here, and its panels (None where
    the C++ kernel does not read it): packed for oneDNN with panels aliasing it, panels
    alone (`own_panels`), or plain (float32 column-major: see `lay_out_for_cpu`)."""
    if can_pack(weight):
        packed = pack_weight(weight)
        panels = weight_panels(weight, packed)
        # oneDNN lays bfloat16 out otherwise where the CPU has no bf16 dot products
        # (AVX-512 without AVX512-BF16), and converts it on every call: panels alone.
        if panels is None and weight.dtype == torch.bfloat16:
            own = own_panels(weight)
            if own is not None:
                return panels_only_weight(weight), own
        return packed, panels
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and (own := own_panels(weight)) is not None):
        return panels_only_weight(weight), own
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        return weight.t().contiguous().t(), None
    return weight, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for a plain or a packed weight; `panels`, the packed
    weight's `weight_panels`, lets the C++ kernel take the calls with few rows."""
    if panels is not None and (ops := cpu_ops(x)) is not None:
        return ops.linear(x, weight, panels, _ABSENT if bias is None else bias)
    if panels is not None and is_panels_only(weight):
        # The C++ kernels were switched off after load (CORESTREAM_KERNELS=torch): slow,
        # but the same values.
        weight = unpack_panels(panels, *weight.shape)
    if weight.is_mkldnn:
        rows = x.reshape(-1, x.size(-1))
        bucket = onednn_rows(rows.size(0))
        if bucket != rows.size(0):
            rows = F.pad(rows, (0, 0, 0, bucket - rows.size(0)))
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return out[:x.numel() // x.size(-1)].reshape(*x.shape[:-1], out.size(-1))
    return F.linear(x, weight, bias)


def onednn_rows(rows: int) -> int:
    """The rows oneDNN's matmul runs for `rows` rows of x: up to a bucket, eight per
    doubling (at most 12.5% padding). oneDNN builds one primitive per row count (~5 ms,
    ~0.6 MiB each, up to 1,024 kept), so prefills of every length grew an engine by
    hundreds of MiB; buckets bound that to a few dozen. The C++ `linear` does the same
    (kernels/corestream_kernels/csrc/linear_cpu.cpp)."""
    if rows <= 8:
        return rows
    step = 8
    while step * 16 < rows:
        step *= 2
    return -(-rows // step) * step


def onednn_buckets(max_rows: int) -> list[int]:
    """Every row count oneDNN's matmul runs for inputs of 1 to `max_rows` rows."""
    return sorted({onednn_rows(rows) for rows in range(1, max_rows + 1)})


Layer = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""A linear layer's (weight, bias, panels), as `linear` takes them."""


def warm_onednn(layers: Iterable[Layer], max_rows: int) -> int:
    """Run each packed layer shape once at every row bucket up to `max_rows`, through
    `linear` as the model does, so that oneDNN builds its primitives now: later inputs
    of any length neither wait for one (~5 ms) nor grow the process (~0.6 MiB each; a
    bias, the dtype and the shape each make another). Returns the calls made."""
    kinds: dict[tuple[object, ...], Layer] = {}
    for weight, bias, panels in layers:
        if weight.is_mkldnn:
            key = (tuple(weight.shape), weight.dtype, bias is not None, panels is not None)
            kinds.setdefault(key, (weight, bias, panels))
    buckets = onednn_buckets(max_rows)
    with torch.inference_mode():
        for weight, bias, panels in kinds.values():
            for rows in buckets:
                linear(torch.zeros(rows, weight.size(1), dtype=weight.dtype), weight, bias,
                       panels)
    return len(kinds) * len(buckets)


_ABSENT = torch.empty(0)
