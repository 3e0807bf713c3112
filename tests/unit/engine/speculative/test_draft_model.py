"""Speculation with a draft model in the runner: a draft equal to the target has every
greedy draft accepted, a smaller one (the target's first layer) gives the outputs of
plain decoding for greedy, seeded and penalized requests, also under preemption, and a
draft of another vocabulary or tokenizer is refused, naming the difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from services.common.tiny_checkpoint import resolve_model
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.request import Request
from services.engine.worker.config import RunnerConfig
from services.engine.worker.draft_model import DraftMismatch
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.fakes import call, collect, ok, prompt_of, real_request, run_core, tokens

TINY = resolve_model("")


def spec(draft: Path, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft),
                       "num_speculative_tokens": k, "disable_by_batch_size": 8,
                       "min_acceptance_rate": 0.0})


def first_layer_of(target: Path, folder: Path) -> Path:
    """The target cut to its first layer: same embeddings, head and tokenizer, so its
    guesses agree with the target's now and then."""
    shutil.copytree(target, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in load_file(str(target / "model.safetensors")).items()
               if ".layers." not in k or ".layers.0." in k}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def runner(draft: Path | None, kv: str = "8MiB", max_model_len: int = 0) -> ModelRunner:
    r = ModelRunner(RunnerConfig(kv_cache_memory=kv, max_model_len=max_model_len),
                    draft_model=str(draft or ""))
    r.warmup()
    return r


def requests(vocab: int, max_tokens: int = 40, **sampling: object) -> list[Request]:
    out = []
    for i, n in enumerate((30, 11, 23, 7)):
        prompt = prompt_of(n, i, vocab)
        out.append(real_request(f"d{i}", prompt + prompt, max_tokens, **sampling))
    return out


@pytest.fixture(scope="module")
def plain() -> ModelRunner:
    return runner(None)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return first_layer_of(TINY, tmp_path_factory.mktemp("draft") / "tiny-1-layer")


@pytest.mark.timeout(120)
def test_a_draft_equal_to_the_target_has_every_greedy_draft_accepted(
        plain: ModelRunner) -> None:
    vocab = plain.model_info.vocab_size
    expected, _ = run_core(plain, requests(vocab))
    got, core = run_core(runner(TINY), requests(vocab), speculative_config=spec(TINY))
    assert {r: tokens(u) for r, u in got.items()} == {r: tokens(u) for r, u in expected.items()}
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 10
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # Each request: its first step, then verify steps of 5 tokens (4 drafts and one more).
    assert stats.mean_accepted_length > 4.5


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sampling", [
    {}, {"temperature": 0.9, "seed": 3},
    {"temperature": 0.8, "seed": 9, "repetition_penalty": 1.2, "min_tokens": 30, "logprobs": 2},
], ids=["greedy", "seeded", "seeded-penalties-logprobs"])
def test_a_smaller_draft_gives_the_outputs_of_plain_decoding(
        plain: ModelRunner, small_draft: Path, sampling: dict[str, object]) -> None:
    vocab = plain.model_info.vocab_size
    expected, _ = run_core(plain, requests(vocab, **sampling))
    got, core = run_core(runner(small_draft), requests(vocab, **sampling),
                         speculative_config=spec(small_draft))
    assert {r: tokens(u) for r, u in got.items()} == {r: tokens(u) for r, u in expected.items()}
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 10 and stats.num_accepted_tokens > 0


@pytest.mark.timeout(180)
def test_preemption_with_a_draft_model_loses_nothing(plain: ModelRunner,
                                                     small_draft: Path) -> None:
    vocab = plain.model_info.vocab_size
    many = requests(vocab, 60) + [real_request(f"x{i}", prompt_of(40, 10 + i, vocab), 60)
                                  for i in range(4)]
    expected, _ = run_core(plain, many)
    tight = runner(small_draft, kv="160KiB", max_model_len=256)  # 20 blocks of 16
    again = requests(vocab, 60) + [real_request(f"x{i}", prompt_of(40, 10 + i, vocab), 60)
                                   for i in range(4)]
    got, core = run_core(tight, again, speculative_config=spec(small_draft))
    assert core.scheduler.num_preemptions > 0
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
    assert {r: tokens(u) for r, u in got.items()} == {r: tokens(u) for r, u in expected.items()}
    core.scheduler.kv_cache.check_integrity()


@pytest.mark.timeout(120)
def test_admin_stats_and_sleep_with_a_draft_model(small_draft: Path) -> None:
    r = runner(small_draft)
    core = EngineCore(EngineConfig(speculative_config=spec(small_draft)), r)
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(real_request("a", prompt_of(20, 1, 394), 30))
        before = tokens(collect(q, {"a"})[0]["a"])
        assert ok(call(core, q, "sleep", {"level": 1}))
        assert r.draft is not None and not r.draft.kv_caches
        ok(call(core, q, "wake_up"))
        core.add_request(real_request("b", prompt_of(20, 1, 394), 30))
        assert tokens(collect(q, {"b"})[0]["b"]) == before
        stats = ok(call(core, q, "get_stats"))["speculative_decoding"]
        assert stats["num_drafts"] > 0
    finally:
        core.shutdown()


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(TINY, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 500
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftMismatch, match="vocabulary of 500 tokens, the target .* 394"):
        ModelRunner(RunnerConfig(kv_cache_memory="8MiB"), draft_model=str(other))

    renamed = tmp_path / "other-tokenizer"
    shutil.copytree(TINY, renamed)
    tok = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "_renamed"] = vocab.pop(first)
    (renamed / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftMismatch, match="tokenizer differs"):
        ModelRunner(RunnerConfig(kv_cache_memory="8MiB"), draft_model=str(renamed))


def test_the_engine_refuses_draft_model_speculation_on_a_runner_without_one(
        plain: ModelRunner) -> None:
    with pytest.raises(ValueError, match="needs an executor built with the draft model"):
        EngineCore(EngineConfig(speculative_config=spec(TINY)), plain)


@pytest.mark.timeout(300)
def test_on_the_benchmark_shapes_a_small_draft_and_a_self_draft_give_plain_outputs(
        tmp_path: Path) -> None:
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    shapes = {"vocab_size": 4096, "max_position_embeddings": 2048, "initializer_range": 0.02}
    make_checkpoint(tmp_path / "bench", "llama", hidden_size=512, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408,
                    **shapes)
    make_checkpoint(tmp_path / "small", "llama", hidden_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=344,
                    **shapes)

    def bench_runner(draft: str) -> ModelRunner:
        r = ModelRunner(RunnerConfig(model=str(tmp_path / "bench"), kv_cache_memory="64MiB"),
                        draft_model=draft)
        r.warmup()
        return r

    def reqs() -> list[Request]:
        return [real_request(f"b{i}", prompt_of(24 + 16 * i, i, 4096), 48) for i in range(4)]

    expected, _ = run_core(bench_runner(""), reqs())
    for draft in ("small", "bench"):
        got, core = run_core(bench_runner(str(tmp_path / draft)), reqs(),
                             speculative_config=spec(tmp_path / draft))
        assert {r: tokens(u) for r, u in got.items()} == {
            r: tokens(u) for r, u in expected.items()}, draft
        stats = core.scheduler.stats().speculation
        assert stats is not None and stats.num_drafts > 10
        if draft == "bench":
            assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.timeout(120)
def test_constrained_requests_with_a_draft_model(plain: ModelRunner) -> None:
    import re

    from tokenizers import Tokenizer

    from services.common.constraints import ConstraintKind, OutputConstraint

    regex = r"(ab|abc|b){10,30}"

    def reqs() -> list[Request]:
        return [real_request(f"c{i}", prompt_of(9 + i, i, 394), 100,
                             constraint=OutputConstraint(ConstraintKind.REGEX, regex),
                             **({"temperature": 1.0, "seed": i} if i % 2 else {}))
                for i in range(4)]

    expected, _ = run_core(plain, reqs())
    got, core = run_core(runner(TINY), reqs(), speculative_config=spec(TINY))
    assert {r: tokens(u) for r, u in got.items()} == {r: tokens(u) for r, u in expected.items()}
    # The draft proposes without the grammar's mask, so its guesses are cut at the first
    # token the grammar refuses (here every one): the requests ran, and plainly.
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_draft_tokens == 0
    detok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    for updates in got.values():
        assert re.fullmatch(regex, detok.decode(tokens(updates)))


@pytest.mark.timeout(120)
def test_a_draft_model_with_the_batch_queue(plain: ModelRunner, small_draft: Path) -> None:
    vocab = plain.model_info.vocab_size
    sampling = {"temperature": 0.9, "seed": 4}
    expected, _ = run_core(plain, requests(vocab, **sampling))
    got, core = run_core(runner(small_draft), requests(vocab, **sampling),
                         max_concurrent_batches=2, speculative_config=spec(small_draft))
    assert {r: tokens(u) for r, u in got.items()} == {r: tokens(u) for r, u in expected.items()}
    stats = core.scheduler.stats().speculation
    assert stats is not None and stats.num_drafts > 0
