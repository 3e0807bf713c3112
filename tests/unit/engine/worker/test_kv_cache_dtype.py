"""--kv-cache-dtype: which caches the runner serves, and that a float16 cache under a float32
model decodes as the float32 one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.worker.config import RunnerConfig
from services.engine.worker.kv_cache_dtype import kv_cache_dtype
from tests.unit.engine.hf_checkpoints import VOCAB, make_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_the_models_dtype_and_float16_for_a_gguf_file_on_cpu() -> None:
    assert kv_cache_dtype("auto", torch.float32, CPU) == torch.float32
    assert kv_cache_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, CPU, gguf=True) == torch.float16
    # Where the kernels take no float16 cache, a GGUF file keeps its model's dtype.
    assert kv_cache_dtype("auto", torch.bfloat16, CPU, gguf=True) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, CUDA, gguf=True) == torch.float32


def test_explicit_dtypes() -> None:
    assert kv_cache_dtype("float16", torch.float32, CPU) == torch.float16
    assert kv_cache_dtype("float32", torch.float32, CPU, gguf=True) == torch.float32
    assert kv_cache_dtype("bfloat16", torch.bfloat16, CUDA) == torch.bfloat16


@pytest.mark.parametrize(("name", "model", "device"), [
    ("float16", torch.bfloat16, CPU),
    ("bfloat16", torch.float32, CPU),
    ("float32", torch.bfloat16, CPU),
    ("float16", torch.float32, CUDA),
])
def test_pairs_the_kernels_do_not_serve_are_refused(
    name: str, model: torch.dtype, device: torch.device
) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_dtype {name} is not served under a"):
        kv_cache_dtype(name, model, device)


def test_an_unknown_name_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        RunnerConfig(kv_cache_dtype="fp8")


def test_a_float16_cache_holds_twice_the_blocks_and_decodes_alike(tmp_path: Path) -> None:
    # The same memory holds twice the blocks; greedy tokens of a random float32 Llama, with
    # a prompt prefilled in two chunks, equal the float32 cache's (the cache's rounding is
    # far below these logits' margins).
    make_checkpoint(tmp_path, "llama")
    full = make_runner(tmp_path, kv_cache_dtype="auto")
    half = make_runner(tmp_path, kv_cache_dtype="float16")
    assert full.kv_caches[0].dtype == torch.float32 and half.kv_caches[0].dtype == torch.float16
    assert half.num_blocks == 2 * full.num_blocks
    prompts = random_prompts({"a": 5, "b": 23, "c": 40}, VOCAB)
    want = generate(full, prompts, 12, first_chunk={"c": 17})
    assert generate(half, prompts, 12, first_chunk={"c": 17}) == want
