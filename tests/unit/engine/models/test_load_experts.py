"""Moving experts onto a rank (`loader.load_experts`): what a rank of an expert-parallel
group does when the group goes on without a rank that never came back and the ranks are
numbered afresh. The rank held half the experts; after the move it holds all of them,
read from the checkpoint, and gives the greedy tokens of the whole model, while every
other weight stays the very tensor it was."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from services.common.gguf_checkpoint import ensure_gguf_view
from services.engine.models import moe
from services.engine.models.loader import load_experts
from services.engine.models.moe import QuantizedExperts, SparseMoeBlock, StackedExperts
from tests.gguf_writer import write_gguf
from tests.unit.engine.hf_checkpoints import PROMPT_LENGTHS, VOCAB, make_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts


@dataclass
class Group:
    """What the experts read of a DP group: where this rank stands in it."""

    rank: int
    world_size: int


def experts_of(runner) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(first, count) of each sparse layer's experts."""
    return [(m.experts.first, m.experts.num_local) for m in runner.model.modules()
            if isinstance(m, SparseMoeBlock)]


def check_move(folder: Path, experts_kind: type, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, VOCAB)
    whole = generate(make_runner(folder), prompts, num_tokens=12)
    group = Group(rank=1, world_size=2)
    monkeypatch.setattr(moe, "current_dp_group", lambda: group)
    runner = make_runner(folder)
    assert set(experts_of(runner)) == {(4, 4)}
    kept = {name: id(p) for name, p in runner.model.named_parameters()
            if ".experts." not in name}
    group.rank, group.world_size = 0, 1  # the group went on without rank 0 of two
    assert load_experts(runner.model, folder, torch.float32, torch.device("cpu")) == range(8)
    assert set(experts_of(runner)) == {(0, 8)}
    assert all(isinstance(m.experts, experts_kind) for m in runner.model.modules()
               if isinstance(m, SparseMoeBlock))
    assert {name: id(p) for name, p in runner.model.named_parameters()
            if ".experts." not in name} == kept
    layout = runner.model.checkpoint_layout
    if layout.source == "safetensors":  # (what live weight updates read; GGUF has none)
        expert_tensors = [name for name in layout.tensors if ".experts.0." in name]
        assert expert_tensors and all(layout.tensors[n].model_name for n in expert_tensors)
        assert any(".experts.0." in name for name in layout.placements)
    assert generate(runner, prompts, num_tokens=12) == whole


def test_a_rank_takes_over_the_experts_of_a_safetensors_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_checkpoint(tmp_path, "qwen2_moe", num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    intermediate_size=96, mlp_only_layers=[1])
    check_move(tmp_path, StackedExperts, monkeypatch)


def test_a_rank_takes_over_the_quantized_experts_of_a_gguf_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = make_checkpoint(tmp_path / "hf", "qwen3_moe", num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=64, head_dim=32)
    file = write_gguf(hf, tmp_path / "moe.gguf", GGMLQuantizationType.Q8_0)
    check_move(ensure_gguf_view(file, tmp_path / "cache"), QuantizedExperts, monkeypatch)
