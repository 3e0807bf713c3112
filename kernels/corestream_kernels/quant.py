"""GGUF's quantized weights: their block formats, a torch reference, and the linear layer
that reads them as they are stored.

A linear layer of a quantized checkpoint holds a `QuantizedWeight`: the file's blocks as
they lie in it (one row of blocks per output feature) and their GGML type. `quant_linear`
multiplies activations by it without ever making a float copy of the whole weight:

- a few rows (decode): the C++ op quantizes the activation rows to 8-bit blocks once per
  call, in two passes (the values, then their rounding residual: about 15 bits, where
  llama.cpp's one pass keeps 8), and takes integer dot products with each weight row's
  blocks (csrc/quant_dot.h): a pass over the packed weight at memory bandwidth. Where the
  C++ kernels run, the loader groups the rows of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and
  Q6_K weights by 16 (`group_rows`: the same bytes, interleaved so that each vector lane
  computes one output feature, csrc/quant_groups.h), 1.1-3x faster than one row at a
  time, and fast enough at many rows that prefills take it too;
- many rows (prefill) of a weight in the file's layout (Q5_K): it dequantizes the
  weight for that call only (one layer's, freed at its end) and multiplies by it
  (csrc/quant_cpu.cpp).

Where the extension is not built (no compiler, CORESTREAM_KERNELS=torch) it runs the
torch reference instead: `dequantize`, then `F.linear`, one weight at a time.

`dequantize` is written in torch ops in the order ggml's own numpy code
(`gguf.quants.dequantize`) rounds, so that the two agree bit for bit (tests/kernels/
test_quant.py). The quantizers make blocks for tests and for quantizing a float
checkpoint on load: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 as ggml does (the same bits as
`gguf.quants.quantize`); the K-quants come only from files.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F

from corestream_kernels.cpu_extension import cpu_ops


class GGMLType(IntEnum):
    """The GGML tensor types served here, numbered as in GGUF files."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


QK_K = 256
"""Values per block of the K-quants (a super-block of 8 or 16 sub-blocks)."""

BLOCK_FORMATS: dict[GGMLType, tuple[int, int]] = {
    # type: (values per block, bytes per block). Layouts, by byte offset:
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    # d f16 | 32 int8 q: x = d q
    GGMLType.Q8_0: (32, 34),
    # d f16 | 16 bytes: value j < 16 in low nibble of byte j, j >= 16 in the high nibble of
    # byte j - 16: x = d (q - 8)
    GGMLType.Q4_0: (32, 18),
    # d f16 | m f16 | 16 bytes of nibbles as Q4_0: x = d q + m
    GGMLType.Q4_1: (32, 20),
    # d f16 | qh: 4 bytes, bit j the fifth bit of value j | 16 bytes of nibbles as Q4_0:
    # x = d (q - 16)
    GGMLType.Q5_0: (32, 22),
    # d f16 | m f16 | qh | nibbles as Q5_0: x = d q + m
    GGMLType.Q5_1: (32, 24),
    # d f16 | dmin f16 | 12 bytes: 8 six-bit scales and 8 six-bit mins | 128 bytes: for
    # each 64 values, 32 bytes, low nibbles the first 32, high nibbles the next:
    # x = d sc[s] q - dmin m[s] for sub-block s of 32 values
    GGMLType.Q4_K: (QK_K, 144),
    # as Q4_K, then 32 bytes qh before the nibbles: value 32 s + l has its fifth bit in
    # bit s of qh[l]
    GGMLType.Q5_K: (QK_K, 176),
    # 128 bytes ql (low 4 bits) | 64 bytes qh (high 2 bits) | 16 int8 scales | d f16:
    # x = d scale[i / 16] (q - 32)
    GGMLType.Q6_K: (QK_K, 210),
}
_Q4K_SCALES = 12


def row_bytes(ggml_type: GGMLType, in_features: int) -> int:
    """Bytes of one weight row of `in_features` values (a whole number of blocks)."""
    block, size = BLOCK_FORMATS[ggml_type]
    if in_features % block:
        raise ValueError(f"{ggml_type.name} takes rows of multiples of {block} values, "
                         f"not {in_features}")
    return in_features // block * size


GROUP_ROWS = 16
"""Rows per group of a grouped weight (see `group_rows`)."""

GROUPED_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                           GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K})
"""The types whose rows can be grouped: the C++ GEMV has grouped kernels for them."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight `[out_features, in_features]` as GGUF stores it: each
    output feature's row of blocks, `blocks[n]` (uint8, contiguous); or, `grouped`, the
    same bytes with the rows interleaved in groups of `GROUP_ROWS` (`group_rows`)."""

    blocks: torch.Tensor
    """uint8 `[out_features, row_bytes(ggml_type, in_features)]`."""
    ggml_type: GGMLType
    in_features: int
    out_features: int
    grouped: bool = False

    def __post_init__(self) -> None:
        want = (self.out_features, row_bytes(self.ggml_type, self.in_features))
        assert self.blocks.dtype == torch.uint8 and tuple(self.blocks.shape) == want, (
            f"{self.ggml_type.name} blocks {tuple(self.blocks.shape)} "
            f"{self.blocks.dtype}, expected {want} uint8")
        assert self.blocks.is_contiguous(), "blocks must be contiguous"
        assert not self.grouped or can_group(self.ggml_type, self.out_features), (
            f"{self.ggml_type.name} [{self.out_features}, ...] cannot be grouped")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @classmethod
    def from_file(cls, data: torch.Tensor, ggml_type: int, shape: tuple[int, int]
                  ) -> QuantizedWeight:
        """The weight of a GGUF tensor: its bytes (any dtype, as a reader maps them) and
        its shape `[out, in]` (GGUF lists dimensions innermost first: reverse them)."""
        out_features, in_features = shape
        kind = GGMLType(ggml_type)
        blocks = data.contiguous().view(torch.uint8).reshape(
            out_features, row_bytes(kind, in_features))
        return cls(blocks, kind, in_features, out_features)


# --- Rows in groups ----------------------------------------------------------------------
#
# The C++ decode GEMV computes 16 output features at once, one per vector lane
# (csrc/quant_groups.h); it reads a weight whose rows are interleaved in groups of 16,
# block by block: per block of a group, each header field (d, then m, then qh, as the type
# has them) of the 16 rows side by side, then the payload (nibbles, or Q8_0's bytes) as
# 4-byte words, word c of the 16 rows side by side for c = 0, 1, ... (csrc/quant_blocks.h).
# A permutation of the file's bytes, the same size: grouping at load time keeps no second
# copy.


def can_group(ggml_type: GGMLType, out_features: int) -> bool:
    """Whether a weight of this type and rows can be grouped (`group_rows`)."""
    return ggml_type in GROUPED_TYPES and out_features % GROUP_ROWS == 0


# A block's header fields (start byte, width) by type: d, m, qh; the payload follows, in
# fields of 4 bytes. (Q6_K: fields of 4 bytes up to its d, last.)
_GROUP_FIELDS = {
    GGMLType.Q4_0: ((0, 2),),
    GGMLType.Q4_1: ((0, 2), (2, 2)),
    GGMLType.Q5_0: ((0, 2), (2, 4)),
    GGMLType.Q5_1: ((0, 2), (2, 2), (4, 4)),
    GGMLType.Q8_0: ((0, 2),),
    GGMLType.Q4_K: ((0, 2), (2, 2), (4, 4), (8, 4), (12, 4)),  # d, dmin, the 12 scale bytes
    GGMLType.Q6_K: (*((start, 4) for start in range(0, 208, 4)), (208, 2)),
}


@functools.cache
def _group_positions(ggml_type: GGMLType, in_features: int) -> torch.Tensor:
    """int64 `[GROUP_ROWS, row_bytes]`: where byte i of a group's row j goes in the
    group's grouped bytes."""
    size = BLOCK_FORMATS[ggml_type][1]
    fields = _GROUP_FIELDS[ggml_type]
    header = sum(width for _, width in fields)  # Q6_K's fields cover its whole block
    # Every byte of a block, as (start, width) of the field or payload word it is in: a
    # byte i of it sits at 16 start + width lane + i in the grouped block.
    spans = [(start, width) for start, width in fields for _ in range(width)]
    spans += [(start, 4) for start in range(header, size, 4) for _ in range(4)]
    start, width = torch.tensor(spans).unbind(-1)
    offset = torch.arange(size)
    lane = torch.arange(GROUP_ROWS).unsqueeze(-1)
    within = GROUP_ROWS * start + width * lane + (offset - start)  # [16, size]
    blocks = row_bytes(ggml_type, in_features) // size
    first = (torch.arange(blocks) * GROUP_ROWS * size).view(1, -1, 1)
    return (first + within.unsqueeze(1)).reshape(GROUP_ROWS, -1)


def group_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight with its rows grouped for the C++ decode GEMV (a copy of the same
    size); as it is if it cannot be (`can_group`) or already is."""
    if weight.grouped or not can_group(weight.ggml_type, weight.out_features):
        return weight
    positions = _group_positions(weight.ggml_type, weight.in_features).flatten()
    rows = weight.blocks.view(-1, positions.numel())  # a group's bytes per row
    grouped = torch.empty_like(rows)
    grouped[:, positions] = rows
    return dataclasses.replace(weight, blocks=grouped.view_as(weight.blocks), grouped=True)


def weight_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight in the file's layout: uint8 `[*ids.shape, row_bytes]`."""
    if not weight.grouped:
        return weight.blocks[ids]
    positions = _group_positions(weight.ggml_type, weight.in_features).to(ids.device)
    groups = weight.blocks.view(-1, positions.numel())
    return groups[(ids // GROUP_ROWS).unsqueeze(-1), positions[ids % GROUP_ROWS]]


def ungroup_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight in the file's layout (a copy if it is grouped)."""
    if not weight.grouped:
        return weight
    rows = weight_rows(weight, torch.arange(weight.out_features, device=weight.blocks.device))
    return dataclasses.replace(weight, blocks=rows.contiguous(), grouped=False)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 field at byte `start` of every block, as float32 `[..., 1]`."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes `[..., g * group]` as nibbles: per group of bytes, the low nibbles first,
    then the high ones: `[..., g * 2 * group]`, uint8."""
    grouped = qs.unflatten(-1, (-1, 1, group))
    both = torch.cat([grouped & 0x0F, grouped >> 4], dim=-2)
    return both.flatten(-3)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes as 8 scales and 8 mins (six bits each), float32."""
    d, m, high = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (high & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (high >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mins.float()


def dequantize_blocks(blocks: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """Blocks `[..., n_blocks * bytes_per_block]` uint8 as float32 `[..., n_blocks *
    values_per_block]`; each product and sum rounded as ggml's numpy reference does."""
    block, size = BLOCK_FORMATS[ggml_type]
    lead = blocks.shape[:-1]
    if ggml_type == GGMLType.F32:
        return blocks.contiguous().view(torch.float32)
    if ggml_type == GGMLType.F16:
        return blocks.contiguous().view(torch.float16).float()
    if ggml_type == GGMLType.BF16:
        return (blocks.contiguous().view(torch.int16).int() << 16).view(torch.float32)
    b = blocks.reshape(*lead, -1, size)  # [..., n_blocks, size]
    if ggml_type == GGMLType.Q8_0:
        values = _f16(b, 0) * b[..., 2:].view(torch.int8).float()
    elif ggml_type == GGMLType.Q4_0:
        values = _f16(b, 0) * (_nibbles(b[..., 2:], 16).float() - 8.0)
    elif ggml_type == GGMLType.Q4_1:
        values = _f16(b, 0) * _nibbles(b[..., 4:], 16).float() + _f16(b, 2)
    elif ggml_type in (GGMLType.Q5_0, GGMLType.Q5_1):
        start = 2 if ggml_type == GGMLType.Q5_0 else 4
        qh = b[..., start:start + 4].contiguous().view(torch.int32)  # little-endian bits
        fifth = (qh >> torch.arange(32, dtype=torch.int32)) & 1
        q = (_nibbles(b[..., start + 4:], 16) | (fifth.to(torch.uint8) << 4)).float()
        if ggml_type == GGMLType.Q5_0:
            values = _f16(b, 0) * (q - 16.0)
        else:
            values = _f16(b, 0) * q + _f16(b, 2)
    elif ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mins = _k_scales(b[..., 4:4 + _Q4K_SCALES])
        scale = (_f16(b, 0) * sc).unsqueeze(-1)  # [..., 8, 1]
        offset = (_f16(b, 2) * mins).unsqueeze(-1)
        start = 4 + _Q4K_SCALES
        if ggml_type == GGMLType.Q5_K:
            qh = b[..., start:start + 32]  # bit s of qh[l]: value 32 s + l
            high = (qh.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).unsqueeze(-1)) & 1
            start += 32
        q = _nibbles(b[..., start:], 32).unflatten(-1, (8, 32))
        if ggml_type == GGMLType.Q5_K:
            q = q | (high << 4)
        values = (scale * q.float() - offset).flatten(-2)
    elif ggml_type == GGMLType.Q6_K:
        ql, qh = b[..., :128], b[..., 128:192]
        scales = b[..., 192:208].view(torch.int8).float()
        low = _nibbles(ql, 64)  # per 128 values: 64 bytes
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).unsqueeze(-1)
        high = (qh.unflatten(-1, (2, 1, 32)) >> shifts) & 3  # [..., 2, 4, 32]
        q = (low | (high.flatten(-3) << 4)).view(torch.int8) - 32
        scale = (_f16(b, 208) * scales).unsqueeze(-1)  # [..., 16, 1]
        values = (scale * q.unflatten(-1, (16, 16)).float()).flatten(-2)
    else:
        raise NotImplementedError(f"no dequantization for {ggml_type!r}")
    return values.reshape(*lead, -1)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The weight as float32 `[out_features, in_features]`: the torch reference."""
    return dequantize_blocks(ungroup_rows(weight).blocks, weight.ggml_type)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """`x @ dequantize(weight).T` for x `[..., in_features]` float32 or bfloat16, in x's
    dtype; the C++ op where it is built, with activations quantized to two 8-bit passes
    for the integer types at few rows (relative error about 2e-5 of the output's norm)."""
    ops = cpu_ops(x)
    if ops is not None and x.dtype in (torch.float32, torch.bfloat16):
        return ops.quant_linear(x, weight.blocks, int(weight.ggml_type),
                                weight.out_features, weight.in_features, weight.grouped)
    return F.linear(x, dequantize(weight).to(x.dtype))


# --- Quantizers, bit for bit as ggml's reference (gguf.quants.quantize) -----------------


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """roundf, halves away from zero (torch.round rounds them to even), as ggml's numpy
    code computes it: floor(x + 0.5) would round 0.49999997 up."""
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + torch.floor(2 * (a - whole)))


def _blocks_of(weight: torch.Tensor, block: int) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[1] % block:
        raise ValueError(f"quantize a 2-D weight of rows of multiples of {block} values, "
                         f"not {tuple(weight.shape)}")
    return weight.detach().float().reshape(weight.shape[0], -1, block)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values in 0..15 as 16 bytes: value j low, j + 16 high."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.half().view(torch.uint8)


def _weight(blocks: torch.Tensor, kind: GGMLType, in_features: int) -> QuantizedWeight:
    rows = blocks.reshape(blocks.shape[0], -1).contiguous()
    return QuantizedWeight(rows, kind, in_features, rows.shape[0])


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out, in]` (in a multiple of 32) as Q8_0 blocks."""
    b = _blocks_of(weight, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = _round_half_away(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return _weight(torch.cat([_f16_bytes(d), q], -1), GGMLType.Q8_0, weight.shape[1])


def quantize_q4_0(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out, in]` (in a multiple of 32) as Q4_0 blocks."""
    b = _blocks_of(weight, 32)
    biggest = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # signed, largest magnitude
    d = biggest / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15)
    return _weight(torch.cat([_f16_bytes(d), _pack_nibbles(q)], -1), GGMLType.Q4_0,
                   weight.shape[1])


def quantize_q4_1(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out, in]` (in a multiple of 32) as Q4_1 blocks."""
    b = _blocks_of(weight, 32)
    high, low = b.amax(-1, keepdim=True), b.amin(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.trunc((b - low) * _inverse(d) + 0.5).clamp(0, 15)
    return _weight(torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_nibbles(q)], -1),
                   GGMLType.Q4_1, weight.shape[1])


def quantize_int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out, in]` (in a multiple of 32) as int8 with one scale per output channel
    (row), d = max|row| / 127 rounded to float16, laid out as Q8_0 blocks that all carry
    their row's d: the layout the Q8_0 kernels read, 34 bytes per 32 values."""
    b = _blocks_of(weight, 32)
    d = (b.abs().amax((-2, -1), keepdim=True) / 127).half().float()  # [out, 1, 1]
    q = _round_half_away(b * _inverse(d)).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    scales = _f16_bytes(d.expand(-1, b.shape[1], 1))
    return _weight(torch.cat([scales, q], -1), GGMLType.Q8_0, weight.shape[1])


def _pack_fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values in 0..31: bit 4 of value j as bit j of 4 little-endian bytes."""
    bits = (q.to(torch.int64) >> 4) << torch.arange(32)
    return bits.sum(-1, keepdim=True).to(torch.int32).view(torch.uint8)


def quantize_q5_0(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out, in]` (in a multiple of 32) as Q5_0 blocks."""
    b = _blocks_of(weight, 32)
    biggest = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # signed, largest magnitude
    d = biggest / -16
    q = torch.trunc(b * _inverse(d) + 16.5).clamp(0, 31)
    return _weight(torch.cat([_f16_bytes(d), _pack_fifth_bits(q), _pack_nibbles(q % 16)], -1),
                   GGMLType.Q5_0, weight.shape[1])


def quantize_q5_1(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out, in]` (in a multiple of 32) as Q5_1 blocks."""
    b = _blocks_of(weight, 32)
    high, low = b.amax(-1, keepdim=True), b.amin(-1, keepdim=True)
    d = (high - low) / 31
    q = torch.trunc((b - low) * _inverse(d) + 0.5).clamp(0, 31)
    return _weight(torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_fifth_bits(q),
                              _pack_nibbles(q % 16)], -1), GGMLType.Q5_1, weight.shape[1])


WIDENS_TO_Q8_0 = frozenset({GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0})
"""The types whose blocks Q8_0 holds exactly: d (q - centre) with the same f16 d and
q - centre within int8."""


def widen_to_q8_0(weight: QuantizedWeight) -> QuantizedWeight:
    """A Q4_0, Q5_0 (or Q8_0) weight as Q8_0 blocks of the same values, bit for bit: each
    block's d as it is, its q - 8 (or q - 16) as int8. For fused projections whose parts a
    file stores in two such types (a Q4_K_M file's q and k in Q5_0, v in Q8_0): one type,
    so one weight, at 34 bytes per 32 values where Q5_0 had 22."""
    kind = weight.ggml_type
    if kind not in WIDENS_TO_Q8_0:
        raise ValueError(f"{kind.name} blocks are not exactly Q8_0 blocks")
    if kind == GGMLType.Q8_0:
        return weight
    file_layout = ungroup_rows(weight)
    size = BLOCK_FORMATS[kind][1]
    b = file_layout.blocks.reshape(weight.out_features, -1, size)
    if kind == GGMLType.Q4_0:
        q = _nibbles(b[..., 2:], 16).to(torch.int16) - 8
    else:
        qh = b[..., 2:6].contiguous().view(torch.int32)
        fifth = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
        q = (_nibbles(b[..., 6:], 16) | (fifth << 4)).to(torch.int16) - 16
    blocks = torch.cat([b[..., :2], q.to(torch.int8).view(torch.uint8)], dim=-1)
    return _weight(blocks, GGMLType.Q8_0, weight.in_features)


def as_float_weight(weight: torch.Tensor, kind: GGMLType) -> QuantizedWeight:
    """`weight` `[out, in]` stored as F32, F16 or BF16 blocks (as a GGUF file may)."""
    dtype = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16,
             GGMLType.BF16: torch.bfloat16}[kind]
    data = weight.detach().to(dtype).contiguous().view(torch.uint8)
    return QuantizedWeight(data, kind, weight.shape[1], weight.shape[0])
