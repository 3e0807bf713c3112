from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from corestream_kernels import cpu_isa

from tests.gguf_models import llama_cpp_record, require_smollm2_gguf

# CORESTREAM_CPU_ISA=avx2 (the forced suite of `make test`) caps oneDNN and ATen too; they
# read their caps once, so before any test module imports torch.
cpu_isa.apply_to_libraries()


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: triton decides when it is first imported whether its own @jit helpers (tl.max,
    # tl.cdiv, ...) run in its interpreter, and any test module that imports transformers
    # imports triton. Without CUDA the Triton kernel tests run in the interpreter, so the
    # switch goes on before the first test module is collected, in whatever order.
    if not _cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    # The C++ CPU kernels compile on first use, about a minute on 2 cores and more on a
    # loaded machine (or whenever another checkout's build of the same sources last used
    # the cache). Built here, the compile counts against no test's timeout, instead of
    # against that of whichever test needs the kernels first.
    if importlib.util.find_spec("torch") is None:
        return
    from corestream_kernels.cpu_extension import load

    load()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF file; tests needing it skip without it."""
    return require_smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_view(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 file's checkpoint view (config.json, tokenizer.json, ...)."""
    from services.common.gguf_checkpoint import ensure_gguf_view

    return ensure_gguf_view(smollm2_gguf, tmp_path_factory.mktemp("gguf-cache"))


@pytest.fixture(scope="session")
def smollm2_llama_cpp(smollm2_gguf: Path) -> dict[str, Any]:
    """llama.cpp's recorded outputs on the SmolLM2 file."""
    return llama_cpp_record(smollm2_gguf)
