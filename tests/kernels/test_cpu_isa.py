"""The instruction sets the CPU paths use (`corestream_kernels.cpu_isa`), and proof that a forced
level reaches all three libraries: `make test` runs the kernel, loader and model suites
again under CORESTREAM_CPU_ISA=avx2, and this module's last test fails there if the
cap did not take (oneDNN still packing bfloat16, ATen still on AVX-512, the extension
built for the machine)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from corestream_kernels import backend, cpu_extension, cpu_isa
from corestream_kernels.cpu_linear import onednn_bf16

ROOT = Path(__file__).resolve().parents[2]
ZEN3 = frozenset({"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma",
                  "f16c", "bmi1", "bmi2"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}
SKYLAKE = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}


def target_on(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], level: str,
              machine: str = "x86_64") -> cpu_isa.CpuTarget:
    monkeypatch.setenv(cpu_isa.ENV, level)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: machine)
    cpu_isa.target.cache_clear()
    try:
        return cpu_isa.target()
    finally:
        cpu_isa.target.cache_clear()


@pytest.mark.parametrize(("flags", "name"), [(ZEN4, "avx512_bf16"), (SKYLAKE, "avx512"),
                                             (ZEN3, "avx2"), (frozenset({"sse2"}), "baseline")])
def test_auto_names_what_the_cpu_has_and_builds_for_it(
        monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], name: str) -> None:
    target = target_on(monkeypatch, flags, "auto")
    assert (target.name, target.compile_flags, target.x86) == (name, ("-march=native",), True)


def test_a_forced_level_builds_for_that_level(monkeypatch: pytest.MonkeyPatch) -> None:
    target = target_on(monkeypatch, ZEN4, "AVX2")
    assert target.name == "avx2"
    assert target.compile_flags == ("-march=x86-64-v3", "-mtune=native")
    assert target_on(monkeypatch, ZEN4, "avx512").compile_flags[0] == "-march=x86-64-v4"


def test_a_level_the_cpu_lacks_or_no_level_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="avx512 needs CPU flags this CPU lacks: avx512bw"):
        target_on(monkeypatch, ZEN3, "avx512")
    with pytest.raises(ValueError, match=r"CORESTREAM_CPU_ISA='sse9'; expected one of auto"):
        target_on(monkeypatch, ZEN4, "sse9")


def test_other_machines_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    target = target_on(monkeypatch, frozenset({"fp", "asimd"}), "auto", machine="aarch64")
    assert (target.name, target.x86) == ("aarch64", False)


def test_the_libraries_get_the_cap_unless_set_already(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    environ = {"ATEN_CPU_CAPABILITY": "default"}
    cpu_isa.apply_to_libraries(environ)
    assert environ == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    monkeypatch.setenv(cpu_isa.ENV, "auto")
    untouched: dict[str, str] = {}
    cpu_isa.apply_to_libraries(untouched)
    assert untouched == {}


def test_the_cli_refuses_an_unknown_level() -> None:
    env = {**os.environ, cpu_isa.ENV: "avx1024"}
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "CORESTREAM_CPU_ISA='avx1024'" in done.stderr


def test_this_process_runs_the_level_it_was_given(cpu_ops: Any) -> None:
    target = cpu_isa.target()
    assert cpu_ops.panel_linear_supported(torch.float32) == (target.name != "baseline")
    if target.level == "avx2":
        # The suite's forced run: every library below AVX-512, as on a Zen 3.
        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        assert not onednn_bf16()
        assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    elif target.level == "auto" and target.name == "avx512_bf16":
        assert torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16")
        assert onednn_bf16()


def test_off_x86_the_extension_is_not_built_and_one_line_says_so(
        monkeypatch: pytest.MonkeyPatch, kernels_backend: None,
        caplog: pytest.LogCaptureFixture) -> None:
    aarch64 = cpu_isa.CpuTarget("auto", "aarch64", ("-march=native",), False)
    monkeypatch.setattr(cpu_extension, "target", lambda: aarch64)
    monkeypatch.setattr(cpu_extension, "_ops", None)
    monkeypatch.setattr(cpu_extension, "_failed", False)
    backend.set_backend("auto")
    with caplog.at_level(logging.WARNING, logger="corestream_kernels.cpu_extension"):
        assert cpu_extension.load() is None
        assert cpu_extension.load() is None  # once per process
    (record,) = caplog.records
    assert record.getMessage() == ("CPU kernels unavailable, using the torch path: the C++ "
                                   "kernels are built for x86-64 only, not aarch64")
