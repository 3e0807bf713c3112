"""Sleep in one model runner: level 1 gives the KV cache's pages back to the system and
wake takes them again; level 2 drops the weights, which an update (every tensor) or a
reload of the checkpoint brings back. Afterwards the model computes what it did before.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.engine.weights.sources import SourceSpec
from services.engine.weights.staging import WeightUpdateError, dropped_parameters
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import make_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

PROMPTS = {"a": 7, "b": 12}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _outputs(runner: ModelRunner) -> dict[str, list[int]]:
    return generate(runner, random_prompts(PROMPTS, 256), 6)


def _update(runner: ModelRunner, folder: Path) -> list[str]:
    runner.open_weight_update()
    runner.stage_weights(SourceSpec("disk", str(folder)))
    return runner.commit_weights()


def test_level_1_gives_the_cache_pages_back_and_wake_serves_as_before(
        tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m", "llama", torch.float32)
    runner = make_runner(tmp_path / "m")
    runner = ModelRunner(dataclasses.replace(runner.config, kv_cache_memory=256 << 20))
    before = _outputs(runner)
    num_blocks = runner.num_blocks
    # Commit every page of the cache (requests would, block by block).
    for layer in range(len(runner.kv_caches)):
        runner.kv_caches[layer].fill_(0.5)
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert kv_bytes >= 200 << 20
    rss = _rss_bytes()
    freed = runner.sleep(1)
    assert freed == {"kv_cache_bytes": kv_bytes, "kv_cache_resident_bytes": kv_bytes,
                     "weights_bytes": 0}
    assert rss - _rss_bytes() >= 0.9 * kv_bytes
    assert runner.num_blocks == num_blocks
    runner.wake_kv_cache()
    assert runner.num_blocks == num_blocks
    assert all(not c.any() for c in runner.kv_caches)  # zeros again
    assert _outputs(runner) == before


@pytest.mark.parametrize("tied", [False, True])
def test_level_2_drops_the_weights_and_a_reload_brings_them_back(
        tmp_path: Path, tied: bool) -> None:
    make_checkpoint(tmp_path / "m", "llama", torch.float32, tie_word_embeddings=tied)
    runner = make_runner(tmp_path / "m")
    before = _outputs(runner)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    freed = runner.sleep(2)
    assert freed["weights_bytes"] == weights
    assert runner.weights_dropped and dropped_parameters(runner.model)
    runner.wake_kv_cache()
    replaced = _update(runner, tmp_path / "m")
    assert "model.layers.0.self_attn.qkv_proj.weight" in replaced
    assert not runner.weights_dropped
    assert _outputs(runner) == before


def test_a_partial_update_cannot_bring_dropped_weights_back(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path / "m", "llama", torch.float32)
    (tmp_path / "part").mkdir()
    save_file({"model.norm.weight": hf.state_dict()["model.norm.weight"].clone()},
              tmp_path / "part" / "model.safetensors")
    (tmp_path / "qkv").mkdir()
    save_file({name: t.clone() for name, t in hf.state_dict().items()
               if name != "model.layers.0.self_attn.k_proj.weight"},
              tmp_path / "qkv" / "model.safetensors")
    runner = make_runner(tmp_path / "m")
    before = _outputs(runner)
    runner.sleep(2)
    with pytest.raises(WeightUpdateError, match="does not replace .* of them"):
        _update(runner, tmp_path / "part")
    with pytest.raises(WeightUpdateError, match="qkv_proj.weight' was dropped .* only some"):
        _update(runner, tmp_path / "qkv")
    assert runner.weights_dropped
    runner.wake_kv_cache()
    _update(runner, tmp_path / "m")
    assert _outputs(runner) == before


def test_level_2_is_refused_where_the_weights_could_not_come_back(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m", "llama", torch.float32)
    config = RunnerConfig(model=str(tmp_path / "m"), dtype="float32", device="cpu",
                          block_size=4, kv_cache_memory=4 << 20, max_model_len=128,
                          quantization="int8")
    runner = ModelRunner(config)
    with pytest.raises(WeightUpdateError, match="sleep level 2 drops the weights.*int8"):
        runner.sleep(2)
    assert runner.kv_caches  # nothing freed
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        runner.sleep(3)
