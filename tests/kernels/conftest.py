from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from corestream_kernels import backend, cpu_extension
from corestream_kernels.cpu_extension import load
from corestream_kernels.cpu_paged_attention import DecodeFn


@pytest.fixture(scope="session")
def cpu_ops() -> Any:
    """`torch.ops.corestream_cpu`, the extension built (or loaded from the on-disk cache)
    once per session.

    Skips only where there is no compiler; with one, a failed build fails the test.
    """
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    previous = backend.get_backend()
    backend.set_backend("cpp")  # a build error raises instead of falling back
    start = time.perf_counter()
    try:
        ops = load()
    finally:
        backend.set_backend(previous)
    assert ops is not None
    print(f"\nCPU kernels built/loaded in {time.perf_counter() - start:.1f}s")
    return ops


@pytest.fixture(scope="session")
def cpu_kernel(cpu_ops: Any) -> DecodeFn:
    """The C++ decode kernel."""
    return cpu_ops.paged_decode


@pytest.fixture
def kernels_backend() -> Iterator[None]:
    """Restores the kernels backend a test changes."""
    previous = backend.get_backend()
    yield
    backend.set_backend(previous)


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch, kernels_backend: None) -> pytest.MonkeyPatch:
    """The CPU extension as before its first use, with a build that always fails."""
    monkeypatch.setattr(cpu_extension, "_ops", None)
    monkeypatch.setattr(cpu_extension, "_failed", False)

    def failing_build() -> Any:
        raise RuntimeError("Error building extension 'corestream_cpu'")

    monkeypatch.setattr(cpu_extension, "_build", failing_build)
    return monkeypatch
