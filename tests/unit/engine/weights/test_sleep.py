"""Sleep in one model runner: level 1 gives the KV cache's pages back to the system and
wake takes them again; level 2 drops the weights, which an update (every tensor) or a
reload of the checkpoint brings back. Afterwards the model computes what it did before.
"""

from __future__ import annotations

import subprocess
import sys
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
REPO = Path(__file__).resolve().parents[4]


def _outputs(runner: ModelRunner) -> dict[str, list[int]]:
    return generate(runner, random_prompts(PROMPTS, 256), 6)


def _update(runner: ModelRunner, folder: Path) -> list[str]:
    runner.open_weight_update()
    runner.stage_weights(SourceSpec("disk", str(folder)))
    return runner.commit_weights()


# Run in a fresh interpreter: what this process allocated before (other tests) must not
# decide what its RSS does. (In one full-suite run, in process, RSS did not move at all:
# to be explained; see the session notes.)
_LEVEL_1 = """
import dataclasses, sys
from pathlib import Path
import torch
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import make_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

folder = Path(sys.argv[1])
make_checkpoint(folder, "llama", torch.float32)
runner = ModelRunner(dataclasses.replace(make_runner(folder).config,
                                         kv_cache_memory=256 << 20))
outputs = lambda: generate(runner, random_prompts({"a": 7, "b": 12}, 256), 6)
before = outputs()
num_blocks = runner.num_blocks
for layer in range(len(runner.kv_caches)):  # commit every page, as requests would
    runner.kv_caches[layer].fill_(0.5)
kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
assert kv_bytes >= 200 << 20
rss_before = rss()
freed = runner.sleep(1)
assert freed == {"kv_cache_bytes": kv_bytes, "kv_cache_resident_bytes": kv_bytes,
                 "weights_bytes": 0}, freed
assert rss_before - rss() >= 0.9 * kv_bytes, (rss_before, rss(), kv_bytes)
assert runner.num_blocks == num_blocks
runner.wake_kv_cache()
assert runner.num_blocks == num_blocks
assert all(not c.any() for c in runner.kv_caches)
assert outputs() == before
print("ok")
"""


def test_level_1_gives_the_cache_pages_back_and_wake_serves_as_before(
        tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _LEVEL_1, str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


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
