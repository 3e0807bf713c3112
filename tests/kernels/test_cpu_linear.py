"""The panel kernel (`panel_linear`, csrc/linear_cpu.cpp) on oneDNN's packed weights or on
panels of its own (bfloat16 where oneDNN cannot take it), against a float64 reference and
oneDNN itself, and the choice `linear` makes between them.

Every test runs the layout this CPU gets (`cpu_layout`); `make test` runs them again with
CORESTREAM_CPU_ISA=avx2, where bfloat16 weights are panels alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from corestream_kernels import backend
from corestream_kernels.cpu_linear import (
    PANEL_WIDTH,
    can_pack,
    cpu_layout,
    is_panels_only,
    linear,
    onednn_buckets,
    onednn_rows,
    own_panels,
    pack_weight,
    panels_only_weight,
    unpack_panels,
    warm_onednn,
    weight_panels,
)

DTYPES = [torch.float32, torch.bfloat16]
# Full panels, a ragged last panel, fewer outputs than one panel; even and odd inputs
# (bfloat16 pairs consecutive inputs), inputs oneDNN pads.
SHAPES = [(1024, 512), (1000, 333), (100, 70), (17, 5), (64, 1)]
# The rows up to which `linear` sends a call to the panel kernel (csrc/linear_cpu.cpp).
MAX_PANEL_ROWS = {torch.float32: 8, torch.bfloat16: 16}


def laid_out(ops: Any, dtype: torch.dtype, out_features: int, in_features: int,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight, as a linear layer holds it on this CPU, and its panels; skips
    only where the build has no panel kernel at all (x86-64 without AVX2)."""
    if not ops.panel_linear_supported(dtype):
        pytest.skip(f"this build has no panel kernel for {dtype}")
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    stored, panels = cpu_layout(weight)
    assert panels is not None, "oneDNN's layout is not the one the kernel reads"
    # Only bfloat16 goes to panels alone (where oneDNN cannot run it, or lays it out
    # otherwise); the rest is packed.
    assert stored.is_mkldnn or (dtype == torch.bfloat16 and is_panels_only(stored))
    return weight, stored, panels


def packed_pair(ops: Any, dtype: torch.dtype, out_features: int, in_features: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`laid_out` for the tests of oneDNN's packed weights: float32 packs on every CPU
    oneDNN runs on."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN packs no weights")
    weight, packed, panels = laid_out(ops, dtype, out_features, in_features, seed)
    assert packed.is_mkldnn
    return weight, packed, panels


def reference_panels(weight: torch.Tensor) -> torch.Tensor:
    """The panel layout, element by element (csrc/linear_cpu.cpp's header): panel p, row
    k, lane j holds weight[64p + j, k]; bfloat16 pairs k = 2q, 2q + 1 in the last dim."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_WIDTH)
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    rows = -(-in_features // pair)
    panels = torch.zeros(num_panels, rows, PANEL_WIDTH, pair, dtype=weight.dtype)
    for n in range(out_features):
        for k in range(in_features):
            panels[n // PANEL_WIDTH, k // pair, n % PANEL_WIDTH, k % pair] = weight[n, k]
    return panels if pair == 2 else panels.squeeze(3)


def assert_near(got: torch.Tensor, want: torch.Tensor, in_features: int) -> None:
    """Within float32 accumulation error over `in_features` products of N(0, 1) values,
    plus, for bfloat16, the result's rounding (half a unit in its 8 bits)."""
    rtol = 1e-6 if got.dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol,
                               atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_panel_linear_matches_a_float64_reference(
    cpu_ops: Any, dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    weight, stored, panels = laid_out(cpu_ops, dtype, out_features, in_features)
    assert panels.shape[0] == -(-out_features // PANEL_WIDTH)
    bias = torch.randn(out_features).to(dtype)
    # Past 96 rows the rows split into blocks (many rows on panels alone: prefill).
    for rows in (1, 2, 3, 4, 5, 7, 9, 16, 97, 200):
        x = torch.randn(rows, in_features).to(dtype)
        for b in (bias, torch.empty(0, dtype=dtype)):
            got = cpu_ops.panel_linear(x, panels, b, out_features)
            want = x.double() @ weight.double().T + (b.double() if b.numel() else 0)
            assert got.shape == (rows, out_features) and got.dtype == dtype
            assert_near(got, want, in_features)
            if not stored.is_mkldnn:
                continue
            onednn = torch.ops.mkldnn._linear_pointwise(
                x, stored, b if b.numel() else None, "none", [], "")
            if dtype == torch.float32:
                assert_near(got, onednn, in_features)
            else:  # two roundings to bfloat16 may land one unit apart
                torch.testing.assert_close(got, onednn, rtol=2.0 ** -7, atol=0)


def test_panel_linear_of_no_rows_is_empty(cpu_ops: Any) -> None:
    _, _, panels = packed_pair(cpu_ops, torch.float32, 100, 70)
    got = cpu_ops.panel_linear(torch.empty(0, 70), panels, torch.empty(0), 100)
    assert got.shape == (0, 100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_sends_few_rows_to_the_panel_kernel_and_more_to_onednn(
    cpu_ops: Any, dtype: torch.dtype
) -> None:
    weight, packed, panels = laid_out(cpu_ops, dtype, 1000, 333)
    if not packed.is_mkldnn:
        pytest.skip("bfloat16 goes to panels alone here: test_panels_alone_take_every_call")
    bias = torch.randn(1000).to(dtype)
    limit = MAX_PANEL_ROWS[dtype]
    for rows in (1, limit, limit + 1, 64):
        x = torch.randn(rows, 333).to(dtype)
        got = linear(x, packed, bias, panels)
        kernel = cpu_ops.panel_linear(x, panels, bias, 1000)
        # oneDNN runs the rows' bucket (onednn_rows): zero rows after x's, dropped after.
        bucket = F.pad(x, (0, 0, 0, onednn_rows(rows) - rows))
        onednn = torch.ops.mkldnn._linear_pointwise(bucket, packed, bias, "none", [],
                                                    "")[:rows]
        # Both agree within rounding; the bits say which one ran.
        assert torch.equal(got, kernel if rows <= limit else onednn), rows
        # Without panels, the packed weight goes to oneDNN at any row count.
        assert torch.equal(linear(x, packed, bias), onednn)


def test_linear_takes_inputs_the_kernel_does_not(cpu_ops: Any) -> None:
    weight, packed, panels = packed_pair(cpu_ops, torch.float32, 128, 64)
    x = torch.randn(2, 3, 64)  # not 2-D: oneDNN's path
    torch.testing.assert_close(linear(x, packed, None, panels), x @ weight.T)
    strided = torch.randn(3, 128)[:, ::2]  # not contiguous
    torch.testing.assert_close(linear(strided, packed, None, panels), strided @ weight.T)


def test_panels_alias_the_packed_weight_and_keep_it_alive(cpu_ops: Any) -> None:
    weight, packed, panels = packed_pair(cpu_ops, torch.float32, 128, 64)
    address = torch.ops.mkldnn.data_ptr(packed)
    assert panels.data_ptr() == address  # no second copy of the weight
    del packed
    x = torch.randn(1, 64)
    torch.testing.assert_close(cpu_ops.panel_linear(x, panels, torch.empty(0), 128),
                               x @ weight.T)


def test_panels_of_another_weight_are_refused(cpu_ops: Any) -> None:
    weight, _, _ = packed_pair(cpu_ops, torch.float32, 128, 64)
    other = pack_weight(torch.randn(128, 64))
    assert weight_panels(weight, other) is None
    assert weight_panels(weight, weight) is None  # not packed at all


def test_panel_linear_names_what_is_wrong(cpu_ops: Any) -> None:
    _, _, panels = packed_pair(cpu_ops, torch.float32, 128, 64)
    with pytest.raises(RuntimeError, match="x has 65 columns, the panels 64 rows"):
        cpu_ops.panel_linear(torch.randn(1, 65), panels, torch.empty(0), 128)
    with pytest.raises(RuntimeError, match="2 panels cannot hold 200 outputs"):
        cpu_ops.panel_linear(torch.randn(1, 64), panels, torch.empty(0), 200)
    with pytest.raises(RuntimeError, match=r"bias must be empty or \[128\]"):
        cpu_ops.panel_linear(torch.randn(1, 64), panels, torch.zeros(3), 128)
    with pytest.raises(RuntimeError, match="panels must be contiguous, of x's dtype"):
        cpu_ops.panel_linear(torch.randn(1, 64).bfloat16(), panels, torch.empty(0), 128)
    with pytest.raises(RuntimeError, match="panels must be"):
        cpu_ops.panel_linear(torch.randn(1, 64), panels.view(2, -1), torch.empty(0), 128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_own_panels_are_the_reference_layout(cpu_ops: Any, dtype: torch.dtype) -> None:
    if not cpu_ops.panel_linear_supported(dtype):
        pytest.skip(f"this build has no panel kernel for {dtype}")
    for out_features, in_features in [(100, 70), (17, 5), (64, 1), (130, 9)]:
        weight = torch.randn(out_features, in_features).to(dtype)
        want = reference_panels(weight)
        own = own_panels(weight)
        assert own is not None and torch.equal(own, want)
        assert torch.equal(unpack_panels(own, out_features, in_features), weight)
        if torch.backends.mkldnn.is_available() and can_pack(weight):
            # oneDNN's packing, where it lays the weight out as the kernel reads; it may
            # pad the inputs further, with zeros.
            got = weight_panels(weight, pack_weight(weight))
            if got is not None:
                rows = want.shape[1]
                assert torch.equal(got[:, :rows], want) and not got[:, rows:].any()
                assert torch.equal(unpack_panels(got, out_features, in_features), weight)


def test_panels_alone_take_every_call(cpu_ops: Any, kernels_backend: None) -> None:
    """bfloat16 where oneDNN cannot run it: the kernel takes every row count and shape,
    and the torch path (the kernels switched off after load) gives the same values."""
    weight, stored, panels = laid_out(cpu_ops, torch.bfloat16, 300, 133)
    if stored.is_mkldnn:
        # This CPU packs bfloat16 for oneDNN: the panels-only layout is built by hand.
        stored, panels = panels_only_weight(weight), reference_panels(weight)
    assert is_panels_only(stored) and stored.untyped_storage().nbytes() == 2
    bias = torch.randn(300).bfloat16()
    for shape in [(1, 133), (16, 133), (17, 133), (300, 133), (2, 5, 133)]:
        x = torch.randn(shape).bfloat16()
        got = linear(x, stored, bias, panels)
        assert got.shape == (*shape[:-1], 300)
        want = x.double() @ weight.double().T + bias.double()
        assert_near(got, want, 133)
        kernel = cpu_ops.panel_linear(x.reshape(-1, 133).contiguous(), panels, bias, 300)
        assert torch.equal(got.reshape(-1, 300), kernel)
        backend.set_backend("torch")
        assert_near(linear(x, stored, bias, panels), want, 133)
        backend.set_backend("auto")
    with pytest.raises(RuntimeError, match="panels-only weight came without its panels"):
        cpu_ops.linear(torch.randn(40, 133).bfloat16(), stored, torch.empty(0), torch.empty(0))


def test_onednn_row_buckets_pad_little_and_are_few(cpu_ops: Any) -> None:
    buckets = {onednn_rows(rows) for rows in range(1, 8193)}
    assert len(buckets) <= 8 + 15 + 8 * 6
    for rows in range(1, 8193):
        bucket = onednn_rows(rows)
        assert bucket >= rows and bucket in buckets
        assert bucket - rows <= (7 if rows <= 128 else rows // 8)
        assert cpu_ops.onednn_rows(rows) == bucket  # the C++ twin (linear_cpu.cpp)


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_onednn_calls_of_every_row_count_share_a_few_primitives(
        cpu_ops: Any, kernels: str) -> None:
    """oneDNN keeps a primitive (~0.6 MiB) per row count it has run: 600 prefill lengths
    grew a process by ~350 MiB before the buckets; now by the buckets' few dozen. The
    values are those of the unpadded rows."""
    weight, packed, panels = packed_pair(cpu_ops, torch.float32, 256, 128)
    previous = backend.get_backend()
    backend.set_backend(kernels)
    try:
        with open("/proc/self/statm") as f:
            before = int(f.read().split()[1])
        for rows in range(9, 609):
            x = torch.randn(rows, 128)
            got = linear(x, packed, None, panels)
            if rows % 50 == 0:
                assert_near(got, (x.double() @ weight.double().T).float(), 128)
        with open("/proc/self/statm") as f:
            grown_mib = (int(f.read().split()[1]) - before) * 4096 / 2**20
    finally:
        backend.set_backend(previous)
    assert grown_mib < 80, f"{grown_mib:.0f} MiB for 600 row counts"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_warmed_primitives_keep_memory_flat_for_every_length() -> None:
    """After warm_onednn, inputs of every length up to its rows build nothing more: the
    soak's engines grew 306 -> 334 MiB over an hour as new lengths came (bursts). Two
    layer shapes no other test uses, with a bias (another primitive than without);
    unwarmed, the same loop builds ~80 primitives (~45 MiB)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN packs no weights")
    layers = []
    for out_features, in_features in ((448, 128), (320, 96)):
        weight = torch.randn(out_features, in_features)
        layers.append((weight, pack_weight(weight), torch.randn(out_features)))
    calls = warm_onednn([(packed, bias, None) for _, packed, bias in layers], 600)
    assert calls == 2 * len(onednn_buckets(600))
    checked = []
    before = _rss_mib()
    for rows in range(1, 601):
        for weight, packed, bias in layers:
            x = torch.randn(rows, weight.size(1))
            got = linear(x, packed, bias)
            if rows % 97 == 0:
                checked.append((x, got, weight, bias))
    grown = _rss_mib() - before
    assert grown < 10, f"{grown:.1f} MiB after warming, for 600 row counts"
    for x, got, weight, bias in checked:  # after: the float64 reference's buffers grow
        assert_near(got, (x.double() @ weight.double().T + bias.double()).float(), x.size(1))
