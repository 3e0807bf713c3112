"""The C++ per-layer ops for CPU (RMSNorm, add + RMSNorm, SiLU-and-mul, rotary + KV write)
against their torch references, their dispatch, and their fallback to torch."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import corestream_kernels.cpu_extension as cpu_extension
import pytest
import torch
import torch.nn.functional as F
from corestream_kernels.activation import silu_and_mul
from corestream_kernels.backend import set_backend
from corestream_kernels.kv_cache import write_kv_cache
from corestream_kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_torch
from corestream_kernels.rotary import apply_rotary, rotate_and_store_kv

DTYPES = [torch.float32, torch.bfloat16]
# float32: the ops sum in another order (and fuse multiply-adds) than torch's kernels.
# bfloat16: both sides compute in float32 and round once per stored tensor, so a
# difference is at most one bfloat16 step of the output, where the float32 values
# straddle a rounding boundary.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}
EPS = 1e-6


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    atol, rtol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 512), (3, 7), (0, 64), (301, 520), (2, 1)])
def test_rms_norm_matches_torch(cpu_ops: Any, rows: int, hidden: int, dtype: torch.dtype) -> None:
    # 301 rows of 520 span several of the kernel's parallel ranges.
    x = randn(rows, hidden, dtype=dtype, scale=3.0)
    weight = randn(hidden, dtype=dtype)
    close(cpu_ops.rms_norm(x, weight, EPS), rms_norm_torch(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(cpu_ops: Any, dtype: torch.dtype) -> None:
    # Qwen3's per-head norm of the q heads, a view into the fused qkv projection.
    qkv = randn(5, 4 + 2 * 2, 24, dtype=dtype, scale=2.0)
    q = qkv[:, :4]
    weight = randn(24, dtype=dtype)
    out = cpu_ops.rms_norm(q, weight, EPS)
    assert out.is_contiguous()
    close(out, rms_norm_torch(q, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 512), (3, 7), (0, 64), (301, 520)])
def test_add_rms_norm_matches_torch(
    cpu_ops: Any, rows: int, hidden: int, dtype: torch.dtype
) -> None:
    x, residual = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, scale=4.0)
    weight = randn(hidden, dtype=dtype)
    want_residual = residual + x
    want = rms_norm_torch(want_residual, weight, EPS)
    cpu_ops.add_rms_norm(x, residual, weight, EPS)  # in place on both
    # The sum is one rounding of the same float32 value on both sides: bit for bit.
    assert torch.equal(residual, want_residual)
    close(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1408), (4, 5), (0, 8), (97, 1000)])
def test_silu_and_mul_matches_torch(
    cpu_ops: Any, rows: int, inter: int, dtype: torch.dtype
) -> None:
    # Gates from -40 to 40: silu's exp under- and overflows at both ends.
    x = randn(rows, 2 * inter, dtype=dtype, scale=10.0)
    if rows:
        x[0, :inter] = torch.linspace(-40, 40, inter).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    close(cpu_ops.silu_and_mul(x), F.silu(gate) * up)


def rotary_case(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """A fused qkv output, cos/sin as RotaryEmbedding.cos_sin lays them out, and caches
    (of `cache_dtype`, default `dtype`) filled with NaN so that the test sees which slots
    a write touched."""
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    qk, value = qkv.split_with_sizes([heads + kv_heads, kv_heads], dim=1)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    caches = torch.full((2, 9, 4, kv_heads, head_dim), float("nan"), dtype=cache_dtype or dtype)
    key_cache, value_cache = caches.unbind()
    return {
        "qk": qk,
        "value": value,
        "cos": torch.cat([cos, cos], dim=-1)[:, None],
        "sin": torch.cat([-sin, sin], dim=-1)[:, None],
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": torch.randperm(36)[:tokens],
    }


def rotary_reference(
    case: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotated qk, key cache, value cache) by `apply_rotary` and `write_kv_cache`."""
    rotated = apply_rotary(case["qk"], case["cos"], case["sin"])
    key_cache, value_cache = case["key_cache"].clone(), case["value_cache"].clone()
    kv_heads = key_cache.shape[2]
    write_kv_cache(rotated[:, -kv_heads:], case["value"], key_cache, value_cache,
                   case["slot_mapping"])
    return rotated, key_cache, value_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [2, 6, 24, 64, 128])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads"), [(1, 8, 4), (5, 4, 4), (30, 6, 2)])
def test_rotary_store_kv_matches_torch(
    cpu_ops: Any, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    case = rotary_case(tokens, heads, kv_heads, head_dim, dtype)
    want_qk, want_keys, want_values = rotary_reference(case)
    args = [case[name] for name in ("qk", "value", "cos", "sin", "key_cache",
                                    "value_cache", "slot_mapping")]
    cpu_ops.rotary_store_kv(*args)
    close(case["qk"], want_qk)
    # NaN marks the slots neither side wrote: they must agree on those too.
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(case["key_cache"], want_keys, atol=atol, rtol=rtol,
                               equal_nan=True)
    assert torch.equal(case["value_cache"].nan_to_num(), want_values.nan_to_num())


@pytest.mark.parametrize("head_dim", [2, 6, 24, 64, 128])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads"), [(1, 8, 4), (30, 6, 2)])
def test_rotary_store_kv_rounds_once_into_a_float16_cache(
    cpu_ops: Any, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    # --kv-cache-dtype float16 under float32: queries rotate in float32, the rotated keys
    # and the values are rounded to float16 as they are stored (write_kv_cache's cast),
    # through the op and through rotate_and_store_kv's dispatch alike.
    for store in (cpu_ops.rotary_store_kv, rotate_and_store_kv):
        case = rotary_case(tokens, heads, kv_heads, head_dim, torch.float32, torch.float16)
        want_qk, want_keys, want_values = rotary_reference(case)
        assert want_keys.dtype == torch.float16
        store(*[case[name] for name in ("qk", "value", "cos", "sin", "key_cache",
                                        "value_cache", "slot_mapping")])
        close(case["qk"], want_qk)
        # The float32 keys differ in their last bits (FMA), so a rounding may go the other
        # way: one float16 step at most.
        torch.testing.assert_close(case["key_cache"], want_keys, atol=1e-3, rtol=1e-3,
                                   equal_nan=True)
        assert torch.equal(case["value_cache"].nan_to_num(), want_values.nan_to_num())


def test_rotary_store_kv_refuses_other_cache_dtypes(cpu_ops: Any) -> None:
    case = rotary_case(3, 4, 2, 8, torch.float32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="float16 under a float32 qk"):
        cpu_ops.rotary_store_kv(*case.values())


def test_rotary_store_kv_rejects_a_slot_outside_the_cache(cpu_ops: Any) -> None:
    case = rotary_case(3, 4, 2, 8, torch.float32)
    case["slot_mapping"][2] = 36
    qk_before = case["qk"].clone()
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 36 outside the cache's 36"):
        cpu_ops.rotary_store_kv(*case.values())
    # Checked before any write: nothing changed.
    assert torch.equal(case["qk"], qk_before)
    assert case["key_cache"].isnan().all() and case["value_cache"].isnan().all()


def test_mismatched_weight_is_a_clear_error(cpu_ops: Any) -> None:
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be a contiguous \[16\]"):
        cpu_ops.rms_norm(x, torch.ones(15), EPS)
    with pytest.raises(RuntimeError, match="weight dtype BFloat16 differs"):
        cpu_ops.add_rms_norm(x, x.clone(), torch.ones(16, dtype=torch.bfloat16), EPS)


def entry_points(dtype: torch.dtype) -> dict[str, Any]:
    """Each public entry point, as a function of nothing, on fresh inputs every call."""

    def add_norm() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        x, residual = randn(3, 40, dtype=dtype), randn(3, 40, dtype=dtype)
        return add_rms_norm(x, residual, torch.linspace(0.5, 2, 40).to(dtype), EPS)

    def norm() -> torch.Tensor:
        torch.manual_seed(4)
        return rms_norm(randn(3, 5, 40, dtype=dtype)[:, 1:4], torch.ones(40, dtype=dtype), EPS)

    def silu() -> torch.Tensor:
        torch.manual_seed(5)
        return silu_and_mul(randn(3, 2 * 33, dtype=dtype, scale=4.0))

    def rotary() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(6)
        case = rotary_case(4, 4, 2, 16, dtype)
        qk = rotate_and_store_kv(*case.values())
        return qk, case["key_cache"].nan_to_num(), case["value_cache"].nan_to_num()

    return {"add_rms_norm": add_norm, "rms_norm": norm, "silu_and_mul": silu,
            "rotate_and_store_kv": rotary}


def flat(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(entry_points(torch.float32)))
def test_entry_points_match_across_backends(
    cpu_ops: Any, kernels_backend: None, name: str, dtype: torch.dtype
) -> None:
    fn = entry_points(dtype)[name]
    set_backend("cpp")
    kernel = flat(fn())
    set_backend("torch")
    reference = flat(fn())
    for got, want in zip(kernel, reference, strict=True):
        close(got, want)


@pytest.mark.parametrize("name", list(entry_points(torch.float32)))
def test_failed_build_falls_back_to_torch(
    unbuilt: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    fn = entry_points(torch.float32)[name]
    set_backend("auto")
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        first, second = flat(fn()), flat(fn())
    set_backend("torch")
    reference = flat(fn())
    for a, b, want in zip(first, second, reference, strict=True):
        assert torch.equal(a, want) and torch.equal(b, want)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()


@pytest.mark.parametrize("name", list(entry_points(torch.float32)))
def test_failed_build_raises_when_kernel_required(unbuilt: pytest.MonkeyPatch, name: str) -> None:
    set_backend("cpp")
    with pytest.raises(RuntimeError, match="Error building"):
        entry_points(torch.float32)[name]()


@pytest.mark.parametrize("name", list(entry_points(torch.float32)))
def test_float16_takes_the_torch_path(unbuilt: pytest.MonkeyPatch, name: str) -> None:
    # The build would fail (and raise, under "cpp"): float16 must not even try it.
    set_backend("cpp")
    for result in flat(entry_points(torch.float16)[name]()):
        assert result.dtype == torch.float16


@pytest.mark.timeout(300)
def test_model_decodes_alike_on_both_backends(
    cpu_ops: Any, kernels_backend: None, tmp_path: Path
) -> None:
    # The whole decoder, every op on the kernels or every op on torch (the path CUDA
    # and a failed build take): the same greedy tokens over prefills, a chunked
    # prefill and decodes.
    from services.common.tiny_checkpoint import ensure_tiny_checkpoint
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner
    from tests.unit.engine.runner_driver import generate, random_prompts

    folder = ensure_tiny_checkpoint(tmp_path)
    config = RunnerConfig(model=str(folder), device="cpu", kv_cache_memory=8 << 20,
                          max_model_len=256)
    tokens = {}
    for name in ("cpp", "torch"):
        set_backend(name)
        runner = ModelRunner(config)
        prompts = random_prompts({"x": 3, "y": 17, "z": 40}, runner.model_info.vocab_size)
        tokens[name] = generate(runner, prompts, num_tokens=24, first_chunk={"z": 20})
    assert tokens["cpp"] == tokens["torch"]


def test_one_build_per_machine_not_per_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    # A second clone with a virtualenv of its own reuses the first clone's build: the key
    # names what the build is made of (torch's version, not where torch lies).
    name = cpu_extension._extension_name()  # noqa: SLF001
    assert name == cpu_extension._extension_name()  # noqa: SLF001
    monkeypatch.setattr(torch, "__file__", "/elsewhere/.venv/site-packages/torch/__init__.py")
    assert cpu_extension._extension_name() == name  # noqa: SLF001
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert cpu_extension._extension_name() != name  # noqa: SLF001


def test_a_second_checkout_loads_the_build_without_compiling(
    cpu_ops: object, tmp_path: Path
) -> None:
    # The kernels' package copied elsewhere, as in another clone of the same commit: its
    # first load imports the cached build and never runs torch's compile step.
    shutil.copytree(Path(cpu_extension.__file__).parent, tmp_path / "corestream_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "import torch.utils.cpp_extension as ext\n"
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError('compiled again')\n"
        "ext.load = refuse\n"
        "from corestream_kernels import backend, cpu_extension\n"
        "backend.set_backend('cpp')\n"
        "assert cpu_extension.__file__.startswith(sys.argv[1]), cpu_extension.__file__\n"
        "assert cpu_extension.load() is not None\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CPU kernels loaded from" in done.stdout
    assert "compiling" not in done.stdout
