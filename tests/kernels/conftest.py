from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import pytest

from kernels import backend
from kernels.cpu_paged_attention import DecodeFn, warm_up


@pytest.fixture(scope="session")
def cpu_kernel() -> DecodeFn:
    """The C++ decode kernel, built (or loaded from the on-disk cache) once per session.

    Skips only where there is no compiler; with one, a failed build fails the test.
    """
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler for the CPU paged-attention kernel")
    previous = backend.get_backend()
    backend.set_backend("cpp")  # a build error raises instead of falling back
    start = time.perf_counter()
    try:
        kernel = warm_up()
    finally:
        backend.set_backend(previous)
    assert kernel is not None
    print(f"\nCPU paged-attention kernel built/loaded in {time.perf_counter() - start:.1f}s")
    return kernel


@pytest.fixture
def kernels_backend() -> Iterator[None]:
    """Restores the kernels backend a test changes."""
    previous = backend.get_backend()
    yield
    backend.set_backend(previous)
