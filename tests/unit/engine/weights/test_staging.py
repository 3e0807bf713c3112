"""Live weight updates in one model runner: staged beside the serving weights, swapped
in whole, and afterwards the model computes exactly what a fresh load of the new
weights computes (packed layouts, fused projections, tied heads, the C++ decode op).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.engine.weights.sources import DiskSource, SourceSpec, wanted_tensors
from services.engine.weights.staging import WeightUpdateError
from services.engine.weights.trainer import write_shared_tensors
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import make_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

PROMPTS = {"a": 7, "b": 12}


def _perturbed(model: torch.nn.Module, names: set[str] | None = None, seed: int = 1
               ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: (p.detach() + 0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
            .contiguous()
            for name, p in model.state_dict().items()
            if names is None or name in names}


def _save(folder: Path, model: torch.nn.Module, new: dict[str, torch.Tensor]) -> None:
    """The checkpoint of `model` with `new` tensors in place of its own."""
    model.load_state_dict(new, strict=False)
    model.save_pretrained(folder)


def _outputs(runner: ModelRunner) -> dict[str, list[int]]:
    return generate(runner, random_prompts(PROMPTS, 256), 6)


def _update(runner: ModelRunner, source: SourceSpec) -> list[str]:
    runner.open_weight_update()
    runner.stage_weights(source)
    return runner.commit_weights()


@pytest.mark.parametrize(("family", "dtype", "tied"), [
    ("llama", "float32", False), ("qwen2", "bfloat16", True), ("qwen3", "float32", False),
])
def test_full_update_from_disk_equals_a_fresh_load(tmp_path: Path, family: str, dtype: str,
                                                   tied: bool) -> None:
    torch_dtype = getattr(torch, dtype)
    hf = make_checkpoint(tmp_path / "old", family, torch_dtype, tie_word_embeddings=tied)
    _save(tmp_path / "new", hf, _perturbed(hf))
    runner = make_runner(tmp_path / "old", dtype)
    before = _outputs(runner)
    replaced = _update(runner, SourceSpec("disk", str(tmp_path / "new")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in replaced
    fresh = make_runner(tmp_path / "new", dtype)
    after = _outputs(runner)
    assert after == _outputs(fresh)
    assert after != before  # the perturbation shows
    for name, param in fresh.model.named_parameters():
        mine = runner.model.get_parameter(name)
        assert mine.shape == param.shape and mine.is_mkldnn == param.is_mkldnn, name


def test_partial_update_replaces_only_its_rows(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path / "old", "llama")
    names = {"model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.norm.weight"}
    new = _perturbed(hf, names)
    (tmp_path / "part").mkdir()
    save_file(new, tmp_path / "part" / "update.safetensors")
    _save(tmp_path / "merged", hf, new)
    runner = make_runner(tmp_path / "old")
    replaced = _update(runner, SourceSpec("disk", str(tmp_path / "part")))
    assert replaced == ["model.layers.0.mlp.gate_up_proj.weight",
                        "model.layers.1.self_attn.qkv_proj.weight", "model.norm.weight"]
    assert _outputs(runner) == _outputs(make_runner(tmp_path / "merged"))


def test_an_update_over_several_calls_builds_fused_weights_from_all_of_them(
        tmp_path: Path) -> None:
    # q, k and v of one fused projection (and gate/up) arrive in separate calls: each
    # call prepares what it has, the next builds on that, and the commit only swaps.
    hf = make_checkpoint(tmp_path / "old", "llama")
    calls = [{"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"},
             {"model.layers.0.self_attn.k_proj.weight"},
             {"model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.self_attn.q_proj.weight"}]
    runner = make_runner(tmp_path / "old")
    runner.open_weight_update()
    merged: dict[str, torch.Tensor] = {}
    for i, names in enumerate(calls):
        new = _perturbed(hf, names, seed=10 + i)
        merged.update(new)
        (tmp_path / f"part{i}").mkdir()
        save_file(new, tmp_path / f"part{i}" / "update.safetensors")
        runner.stage_weights(SourceSpec("disk", str(tmp_path / f"part{i}")))
    before = _outputs(runner)  # still the old weights: nothing is swapped in yet
    assert before == _outputs(make_runner(tmp_path / "old"))
    assert runner.commit_weights() == ["model.layers.0.mlp.gate_up_proj.weight",
                                       "model.layers.0.self_attn.qkv_proj.weight"]
    _save(tmp_path / "merged", hf, merged)
    assert _outputs(runner) == _outputs(make_runner(tmp_path / "merged"))


def test_update_from_shared_memory(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path / "old", "llama")
    new = _perturbed(hf)
    _save(tmp_path / "new", hf, dict(new))
    body = write_shared_tensors(list(new.items()), folder=str(tmp_path))
    runner = make_runner(tmp_path / "old")
    wanted = wanted_tensors(body["names"], body["dtype_names"], body["shapes"])
    _update(runner, SourceSpec("shared_memory", body["path"], tuple(wanted),
                               tuple(body["offsets"])))
    assert _outputs(runner) == _outputs(make_runner(tmp_path / "new"))


@pytest.mark.parametrize(("tensors", "message"), [
    ({"model.layers.0.self_attn.q_projx.weight": torch.zeros(64, 64)},
     "tensor 'model.layers.0.self_attn.q_projx.weight': the model has no such tensor"),
    ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)},
     "tensor 'model.layers.0.self_attn.q_proj.weight': shape [64, 32] differs from the "
     "checkpoint's [64, 64]"),
    ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)},
     "tensor 'model.norm.weight': dtype int32 is not a floating-point type"),
])
def test_a_bad_update_fails_whole_and_changes_nothing(
        tmp_path: Path, tensors: dict[str, torch.Tensor], message: str) -> None:
    hf = make_checkpoint(tmp_path / "old", "llama")
    good = _perturbed(hf, {"model.layers.0.mlp.down_proj.weight"})
    (tmp_path / "bad").mkdir()
    # The good tensor comes first: it must not be applied either.
    save_file({**good, **tensors}, tmp_path / "bad" / "model.safetensors")
    runner = make_runner(tmp_path / "old")
    before = _outputs(runner)
    runner.open_weight_update()
    with pytest.raises(WeightUpdateError, match=message.replace("[", r"\[").replace("]", r"\]")):
        runner.stage_weights(SourceSpec("disk", str(tmp_path / "bad")))
    runner.discard_weights()
    assert _outputs(runner) == before


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "qwen", "qwen2")
    with pytest.raises(WeightUpdateError, match=r"holds a checkpoint of \['Qwen2ForCausalLM'\]; "
                       r"this engine serves \['LlamaForCausalLM'\]"):
        DiskSource(tmp_path / "qwen", ["LlamaForCausalLM"])
