"""Speculative decoding on real runners: outputs equal those without drafts (greedy,
seeded sampling, penalties, logprobs), a model that repeats itself has every draft
accepted, sampling keeps the target's distribution (chi-square), and
preemption and abort in the middle of speculation lose nothing."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.executor.protocol import Executor
from services.engine.request import FinishReason, Request
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.scheduler import Scheduler
from services.engine.speculative.config import SpeculativeConfig
from services.engine.speculative.speculator import Speculator
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.fakes import (
    RecordingRunner,
    call,
    collect,
    ok,
    prompt_of,
    real_request,
    run_core,
    tiny_runner_for_tests,
    tokens,
)
from tests.unit.engine.fixed_logits_checkpoint import VOCAB, write_checkpoint


def spec_config(k: int = 4, **extra: object) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k,
                       "disable_by_batch_size": 8, **extra})


@pytest.fixture(scope="module")
def tiny_runner() -> Executor:
    return tiny_runner_for_tests()


def echoing_requests(vocab: int, max_tokens: int = 48, **sampling: object) -> list[Request]:
    """Prompts that repeat a run of themselves, as an answer that copies would."""
    out = []
    for i, n in enumerate((40, 23, 9, 31)):
        prompt = prompt_of(n, i, vocab)
        out.append(real_request(f"r{i}", prompt + prompt[: n // 2] + prompt,
                                max_tokens, **sampling))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampling", [
    {},
    {"temperature": 0.9, "seed": 7},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 11, "logprobs": 3},
    {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2,
     "logit_bias": ((5, 2.0),), "min_tokens": 20, "logprobs": 2},
], ids=["greedy", "seeded", "seeded-top-k-p-logprobs", "penalties-bias-min-tokens"])
def test_outputs_equal_those_without_speculation(tiny_runner: Executor,
                                                 sampling: dict[str, object]) -> None:
    vocab = tiny_runner.model_info.vocab_size
    plain, _ = run_core(tiny_runner, echoing_requests(vocab, **sampling))
    # One-token lookups too: penalties keep the output from repeating longer runs.
    spec, core = run_core(tiny_runner, echoing_requests(vocab, **sampling),
                          speculative_config=spec_config(min_acceptance_rate=0.0,
                                                         prompt_lookup_min=1))
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
    for rid, updates in plain.items():
        assert tokens(spec[rid]) == tokens(updates), rid
        assert spec[rid][-1].finish_reason is updates[-1].finish_reason
        plain_lp = [lp for u in updates for lp in u.new_logprobs]
        spec_lp = [lp for u in spec[rid] for lp in u.new_logprobs]
        assert len(spec_lp) == len(plain_lp)
        for a, b in zip(spec_lp, plain_lp, strict=True):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def fixed_runner(tmp_path: Path, logits: np.ndarray, max_len: int = 4096) -> ModelRunner:
    folder = write_checkpoint(tmp_path / "fixed", logits, max_position_embeddings=max_len)
    runner = ModelRunner(RunnerConfig(model=str(folder), kv_cache_memory="16MiB",
                                      block_size=16))
    runner.warmup()
    return runner


@pytest.mark.timeout(120)
def test_a_model_that_repeats_itself_has_every_draft_accepted(tmp_path: Path) -> None:
    logits = np.zeros(VOCAB)
    logits[7] = 5.0  # greedy: 7, 7, 7, ...
    runner = fixed_runner(tmp_path, logits)
    out, core = run_core(runner, [real_request("a", (3, 4, 5), 100)],
                         speculative_config=spec_config(k=5))
    assert tokens(out["a"]) == [7] * 100
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.accepted_per_position[0] == stats.num_drafts
    # The first steps have little history to copy (a continuation of 1, 2, 4 tokens),
    # then each yields 6 tokens: 22 steps for 100 tokens where plain decoding takes 100.
    assert len(out["a"]) == 22 and stats.mean_accepted_length > 5


def chi_square_sf4(x: float) -> float:
    """P(X > x) for chi-square with 4 degrees of freedom (closed form for even df)."""
    return math.exp(-x / 2) * (1 + x / 2)


class FixedDrafts:
    """A proposer whose drafts ignore the model: what it proposes is far from the
    target's distribution, so only an exact verification keeps the output on it."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        return self.drafts[:num_tokens]

    def forget(self, request_id: str) -> None:
        pass


@pytest.mark.timeout(300)
@pytest.mark.parametrize("proposer", ["ngram", "fixed"])
def test_sampling_keeps_the_target_distribution(tmp_path: Path, proposer: str) -> None:
    probs = np.array([0.4, 0.25, 0.15, 0.12, 0.08])
    symbols = [10, 11, 12, 13, 14]
    logits = np.full(VOCAB, -1e4)
    logits[symbols] = np.log(probs)
    runner = fixed_runner(tmp_path, logits)
    speculator = Speculator(
        SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3,
                          disable_by_batch_size=8, min_acceptance_rate=0.0),
        FixedDrafts([10, 14, 14, 13]) if proposer == "fixed" else None)
    scheduler = Scheduler(KVCacheManager(runner.num_blocks, runner.block_size),
                          max_model_len=runner.model_info.max_model_len, max_num_seqs=8,
                          speculator=speculator)
    # Unseeded: the runner's generator, as most requests use. The scheduler and runner
    # are driven here on one thread, so the steps (and with them the draws) are the same
    # in every run. With the n-gram proposer five likely tokens repeat often, so lookups
    # find matches and some drafts pass.
    for i in range(8):
        scheduler.add_request(Request(f"s{i}", [10, 11, 12, 10, 11], SamplingParams(
            temperature=1.0, max_tokens=3000, ignore_eos=True), eos_token_ids=(2,)))
    counts: Counter[int] = Counter()
    while scheduler.has_work():
        out = scheduler.schedule()
        for update in scheduler.update_from_output(out, runner.execute(out)):
            counts.update(update.new_token_ids)
    stats = scheduler.stats().speculation
    assert stats is not None and stats.num_accepted_tokens > 1000
    n = sum(counts.values())
    assert n == 8 * 3000 and set(counts) <= set(symbols)
    observed = np.array([counts[s] for s in symbols])

    def statistic(expected_probs: np.ndarray) -> float:
        expected = n * expected_probs
        return float(((observed - expected) ** 2 / expected).sum())

    assert chi_square_sf4(statistic(probs)) > 1e-3, observed / n
    # Power: a bias of 2 points (toward the likeliest token) would give the statistic
    # n * sum(bias^2 / p) = 49.6 on average, far past any threshold (p ~ 4e-10).
    bias = np.array([0.02, -0.01, -0.01, 0.0, 0.0])
    assert chi_square_sf4(n * float((bias**2 / probs).sum())) < 1e-6


@pytest.mark.timeout(120)
def test_preemption_in_the_middle_of_speculation_loses_nothing(
        tiny_runner: Executor) -> None:
    vocab = tiny_runner.model_info.vocab_size
    requests = echoing_requests(vocab, max_tokens=40)
    plain, _ = run_core(tiny_runner, echoing_requests(vocab, max_tokens=40))
    # Room for about two of the four at full length: requests are preempted as they grow.
    tight = RecordingRunner(tiny_runner, num_blocks=18)
    spec, core = run_core(tight, requests, speculative_config=spec_config(
        min_acceptance_rate=0.0))
    assert core.scheduler.num_preemptions > 0
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
    assert {r: tokens(u) for r, u in spec.items()} == {r: tokens(u) for r, u in plain.items()}
    core.scheduler.kv_cache.check_integrity()
    assert core.scheduler.kv_cache.num_free_blocks == 18


@pytest.fixture
def paced_core(tmp_path: Path) -> Iterator[EngineCore]:
    logits = np.zeros(VOCAB)
    logits[7] = 5.0
    folder = write_checkpoint(tmp_path / "paced", logits, max_position_embeddings=4096,
                              corestream_step_seconds=0.01)
    runner = ModelRunner(RunnerConfig(model=str(folder), kv_cache_memory="16MiB",
                                      block_size=16))
    core = EngineCore(EngineConfig(speculative_config=spec_config(k=5)), runner)
    yield core
    core.shutdown()


@pytest.mark.timeout(120)
def test_an_abort_during_a_verify_step_ends_only_that_request(
        paced_core: EngineCore) -> None:
    q = paced_core.sessions.open("s")
    paced_core.start()
    paced_core.add_request(real_request("gone", (3, 4, 5), 3000))
    paced_core.add_request(real_request("kept", (3, 4, 6), 200))
    deadline = time.monotonic() + 30
    while not any(r.num_draft_tokens for r in paced_core.scheduler.running):
        assert time.monotonic() < deadline, "no draft was ever in flight"
        time.sleep(0.001)
    paced_core.abort_requests(["gone"])  # its verify step is executing now
    by_id, _ = collect(q, {"gone", "kept"}, timeout=60)
    assert by_id["gone"][-1].finish_reason is FinishReason.ABORT
    assert len(tokens(by_id["gone"])) < 3000
    assert tokens(by_id["kept"]) == [7] * 200
    deadline = time.monotonic() + 10
    while paced_core.scheduler.has_work():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    kv = paced_core.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.timeout(300)
def test_greedy_output_on_the_benchmark_shapes_equals_plain_decoding(tmp_path: Path) -> None:
    """The benchmark checkpoint's shapes (random weights): plain greedy decoding runs the
    C++ decode op, a verify step the batched forward; their tokens must agree."""
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    make_checkpoint(tmp_path / "bench", "llama", hidden_size=512, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408,
                    vocab_size=4096, max_position_embeddings=2048, initializer_range=0.02)
    runner = ModelRunner(RunnerConfig(model=str(tmp_path / "bench"), kv_cache_memory="64MiB"))
    runner.warmup()
    rng = np.random.default_rng(5)

    def requests() -> list[Request]:
        out = []
        for i in range(6):
            prompt = tuple(int(t) for t in rng.integers(3, 4096, 24 + 16 * i))
            out.append(real_request(f"b{i}", prompt + prompt, 64))
        return out

    rng = np.random.default_rng(5)
    plain, _ = run_core(runner, requests())
    rng = np.random.default_rng(5)
    spec, core = run_core(runner, requests(), speculative_config=spec_config(
        min_acceptance_rate=0.0, prompt_lookup_min=1))
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
    assert {r: tokens(u) for r, u in spec.items()} == {r: tokens(u) for r, u in plain.items()}


@pytest.mark.timeout(120)
def test_admin_stats_report_acceptance(tmp_path: Path) -> None:
    logits = np.zeros(VOCAB)
    logits[7] = 5.0
    core = EngineCore(EngineConfig(speculative_config=spec_config(k=3)),
                      fixed_runner(tmp_path, logits))
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(real_request("a", (3, 4, 5), 60))
        collect(q, {"a"})
        stats = ok(call(core, q, "get_stats"))["speculative_decoding"]
    finally:
        core.shutdown()
    assert stats["num_drafts"] > 0
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == 1.0
    assert stats["accepted_per_position"][0] == stats["num_drafts"]
    assert 3.0 < stats["mean_accepted_length"] <= 4.0


@pytest.mark.timeout(120)
def test_with_the_batch_queue_outputs_equal_those_without_speculation(
        tiny_runner: Executor) -> None:
    vocab = tiny_runner.model_info.vocab_size
    sampling = {"temperature": 0.8, "seed": 3}
    plain, _ = run_core(tiny_runner, echoing_requests(vocab, **sampling))
    spec, core = run_core(tiny_runner, echoing_requests(vocab, **sampling),
                          max_concurrent_batches=2, speculative_config=spec_config(
                              min_acceptance_rate=0.0, prompt_lookup_min=1))
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
    assert {r: tokens(u) for r, u in spec.items()} == {r: tokens(u) for r, u in plain.items()}


@pytest.mark.timeout(120)
def test_prefix_cache_hits_with_speculation_give_plain_outputs(tiny_runner: Executor) -> None:
    vocab = tiny_runner.model_info.vocab_size
    shared = prompt_of(64, 1, vocab)

    def waves() -> tuple[list[Request], list[Request]]:
        return ([real_request("first", shared + shared[:8], 40)],
                [real_request("second", shared + shared[:12], 40)])

    plain, _ = run_core(tiny_runner, *waves())
    spec, core = run_core(tiny_runner, *waves(), speculative_config=spec_config(
        min_acceptance_rate=0.0, prompt_lookup_min=1))
    assert spec["second"][0].num_cached_tokens == 64  # its prefix, cached by the first
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_accepted_tokens > 0
    assert {r: tokens(u) for r, u in spec.items()} == {r: tokens(u) for r, u in plain.items()}
    kv = core.scheduler.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
