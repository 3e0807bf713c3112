"""The engine core over a tensor-parallel executor (rank 0 here, one real worker
process, gloo): the scheduler's paths (mixed batches, chunked prefill, prefix-cache hits,
preemption, prompt logprobs) give exactly the tokens of the in-process runner, and the
executor leaves nothing behind when it closes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.engine.executor.protocol import Executor
from services.engine.parallel.tp_group import current_tp_group
from tests.unit.engine.fakes import (
    RecordingRunner,
    prompt_of,
    real_request,
    run_core,
    tiny_runner_for_tests,
    tokens,
    varied_requests,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def one_rank() -> Executor:
    return tiny_runner_for_tests()


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Executor]:
    from services.engine.executor.tp_executor import TensorParallelExecutor
    from services.engine.worker.config import RunnerConfig

    executor = TensorParallelExecutor(RunnerConfig(kv_cache_memory="8MiB"), 2)
    executor.warmup()
    # Each test's engine core closes its executor when it stops: the wrapper's close
    # does nothing, so the module's tests share one executor.
    yield RecordingRunner(executor)
    executor.close()
    assert current_tp_group() is None  # the next runner built here is whole again
    assert not any(p.is_alive() for p in executor._workers)


def by_request(out: dict) -> dict[str, list[int]]:  # type: ignore[type-arg]
    return {k: tokens(v) for k, v in out.items()}


def test_chunked_mixed_batches_equal_one_rank(one_rank: Executor, two_ranks: Executor) -> None:
    vocab = one_rank.model_info.vocab_size
    expected, _ = run_core(one_rank, varied_requests(vocab), max_num_batched_tokens=2048)
    chunked, _ = run_core(two_ranks, varied_requests(vocab), max_num_batched_tokens=16)
    assert by_request(chunked) == by_request(expected)


def test_preemption_and_seeded_sampling_equal_one_rank(one_rank: Executor,
                                                       two_ranks: Executor) -> None:
    vocab = one_rank.model_info.vocab_size
    sampling = {"temperature": 0.9, "seed": 1234}
    expected, _ = run_core(one_rank, varied_requests(vocab, **sampling))
    tight = RecordingRunner(two_ranks, num_blocks=6)
    squeezed, _ = run_core(tight, varied_requests(vocab, **sampling))
    assert tight.num_preemptions > 0
    assert by_request(squeezed) == by_request(expected)


def test_prefix_hits_and_logprobs_equal_one_rank(one_rank: Executor,
                                                 two_ranks: Executor) -> None:
    vocab = one_rank.model_info.vocab_size
    shared = prompt_of(64, 1, vocab)

    def waves() -> tuple[list, ...]:  # type: ignore[type-arg]
        return ([real_request("first", shared + (5, 6, 7))],
                [real_request("second", shared + (9, 10, 11), logprobs=3)],
                [real_request("third", shared[:20], prompt_logprobs=2)])

    expected, _ = run_core(one_rank, *waves())
    got, _ = run_core(two_ranks, *waves())
    assert got["second"][0].num_cached_tokens == 64
    assert by_request(got) == by_request(expected)
    for rid, field in (("second", "new_logprobs"), ("third", "prompt_logprobs")):
        want = [p for u in expected[rid] for p in (getattr(u, field) or ())]
        have = [p for u in got[rid] for p in (getattr(u, field) or ())]
        assert want and len(have) == len(want), field
        assert [p.token_id for p in have] == [p.token_id for p in want]
        assert [p.logprob for p in have] == pytest.approx([p.logprob for p in want], abs=1e-4)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_speculative_decoding_over_two_ranks_equals_one_rank_without(
        one_rank: Executor, two_ranks: Executor, sampling: dict[str, object]) -> None:
    import json

    vocab = one_rank.model_info.vocab_size

    def echoing() -> list:  # type: ignore[type-arg]
        prompts = [prompt_of(n, i, vocab) for i, n in enumerate((30, 12, 21))]
        return [real_request(f"e{i}", p + p, 24, **sampling) for i, p in enumerate(prompts)]

    expected, _ = run_core(one_rank, echoing())
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_min": 1, "min_acceptance_rate": 0.0})
    got, core = run_core(two_ranks, echoing(), speculative_config=spec)
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
    assert by_request(got) == by_request(expected)
