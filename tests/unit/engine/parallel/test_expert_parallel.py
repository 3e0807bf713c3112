"""Expert parallelism over two real ranks: gloo on 127.0.0.1, one process per rank.

Each rank joins the DP group, builds the model through the real loader and runner,
and so holds only its half of the experts; its outputs must equal those of the whole
model in one process, computed here in the parent. A rank with nothing to run (a dummy
batch of zero tokens) must still join every collective without changing the others'
results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from services.engine.models.loader import load_model
from services.engine.models.moe import SparseMoeBlock
from services.engine.parallel.dp_group import init_dp_group, leave_dp_group
from services.engine.worker.dummy_batch import dummy_forward
from tests.integration.cluster import free_port
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

WORLD = 2
NUM_EXPERTS = 8
# Tokens of each rank in the block tests: unequal, so the gather pads.
SPLIT = (5, 3)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Imported here, not at the top: spawned ranks import this module, and they have
    # no use for transformers.
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    folder = tmp_path_factory.mktemp("qwen2_moe")
    # A shared expert, a dense layer (1) and a sparse one (0): every MLP kind.
    make_checkpoint(folder, "qwen2_moe", num_experts=NUM_EXPERTS, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    intermediate_size=96, mlp_only_layers=[1])
    return folder


def run_ranks(worker: Any, *args: Any) -> None:
    """Run `worker(rank, port, *args)` in WORLD fresh processes; a rank's exception fails
    the test with that rank's traceback."""
    mp.spawn(worker, args=(free_port(), *args), nprocs=WORLD, join=True)


def join(rank: int, port: int) -> None:
    # Two ranks on two cores: one thread each, or they fight over both.
    torch.set_num_threads(1)
    init_dp_group(rank, WORLD, "127.0.0.1", port, timeout_s=60)


def first_block(folder: Path) -> SparseMoeBlock:
    model = load_model(folder, torch.float32, torch.device("cpu"), 128)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    return block


def tokens() -> torch.Tensor:
    return torch.randn(sum(SPLIT), 64, generator=torch.Generator().manual_seed(3))


def block_worker(
    rank: int, port: int, folder: Path, odd_folder: Path, want: torch.Tensor,
    all_w13: torch.Tensor,
) -> None:
    join(rank, port)
    with pytest.raises(ValueError, match="num_experts 3 is not divisible by the "
                       "data-parallel size 2"):
        load_model(odd_folder, torch.float32, torch.device("cpu"), 128)
    block = first_block(folder)
    half = NUM_EXPERTS // WORLD
    # Only this rank's experts were read.
    torch.testing.assert_close(block.experts.w13, all_w13[rank * half : (rank + 1) * half])
    mine = tokens().split(SPLIT)[rank]
    with torch.inference_mode():
        both_busy = block(mine)
        # Rank 1 idle: it runs the layer on zero tokens (a dummy batch).
        one_idle = block(mine if rank == 0 else mine[:0])
        both_idle = block(mine[:0])
    torch.testing.assert_close(both_busy, want.split(SPLIT)[rank], atol=1e-5, rtol=0)
    if rank == 0:
        torch.testing.assert_close(one_idle, want.split(SPLIT)[0], atol=1e-5, rtol=0)
    else:
        assert one_idle.shape == (0, 64)
    assert both_idle.shape == (0, 64)
    leave_dp_group()


def test_block_on_two_ranks_equals_one_process_even_with_an_idle_rank(
    checkpoint: Path, tmp_path: Path
) -> None:
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    make_checkpoint(tmp_path, "mixtral", num_local_experts=3, num_experts_per_tok=2,
                    intermediate_size=32)
    block = first_block(checkpoint)
    with torch.inference_mode():
        # Each rank's tokens on their own, as a single engine would see its batch.
        want = torch.cat([block(x) for x in tokens().split(SPLIT)])
    all_w13 = block.experts.w13.detach()
    assert all_w13.shape[0] == NUM_EXPERTS
    run_ranks(block_worker, checkpoint, tmp_path, want, all_w13)


# Rank 0: four requests, d's prompt in two chunks, so 13 forwards for 12 tokens each.
# Rank 1: two requests for 6 tokens, then 7 dummy forwards while rank 0 finishes.
REQUESTS = ({"a": 5, "b": 13, "c": 1, "d": 22}, {"e": 7, "f": 3})
NUM_TOKENS = (12, 6)
STEPS = 13


def rank_prompts(rank: int) -> dict[str, list[int]]:
    prompts = random_prompts({**REQUESTS[0], **REQUESTS[1]}, vocab=256)
    return {rid: prompts[rid] for rid in REQUESTS[rank]}


def rank_generate(runner: Any, rank: int) -> dict[str, list[int]]:
    first_chunk = {"d": 10} if rank == 0 else {}
    return generate(runner, rank_prompts(rank), NUM_TOKENS[rank], first_chunk)


def model_worker(rank: int, port: int, folder: Path, want: dict[str, list[int]]) -> None:
    join(rank, port)
    runner = make_runner(folder)
    layer0 = runner.model.model.layers[0].mlp
    assert layer0.experts.w13.shape[0] == NUM_EXPERTS // WORLD
    steps = 0
    execute = runner.execute

    def counted(out: Any) -> Any:
        nonlocal steps
        steps += 1
        return execute(out)

    runner.execute = counted  # type: ignore[method-assign]
    got = rank_generate(runner, rank)
    for _ in range(STEPS - steps):
        dummy_forward(runner.model, runner.kv_caches)
    assert steps <= STEPS
    assert got == {rid: want[rid] for rid in REQUESTS[rank]}
    leave_dp_group()


def test_model_on_two_ranks_gives_the_single_engine_tokens(checkpoint: Path) -> None:
    single = make_runner(checkpoint)
    want = {**rank_generate(single, 0), **rank_generate(single, 1)}
    run_ranks(model_worker, checkpoint, want)
