"""Structured output in the engine core, on the real tiny model: outputs follow their
constraints, and constraints change nothing for anyone else.

Random weights make the model's choices arbitrary, which is the point: whatever it
prefers, the mask must keep every output valid, checked by independent validators
(jsonschema, re, lark).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import lark
import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from services.common.constraints import ConstraintKind, OutputConstraint
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState
from services.engine.metrics import EngineMetrics
from services.engine.request import INVALID_ARGUMENT, FinishReason, Request, RequestUpdate
from services.engine.scheduler.scheduler import SchedulerStats
from services.engine.structured.compiler import GrammarCompiler
from tests.unit.engine.fakes import (
    RecordingRunner,
    collect,
    prompt_of,
    run_core,
    tiny_runner_for_tests,
    tokens,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["tags"],
}
REGEX = r"[a-c]{2,5}-[0-9]{3}(\.[0-9]{1,2})?"
GRAMMAR = """start: "(" sum ")"
sum: num ("+" num)*
num: /[0-9]{1,3}/
"""
CHOICES = ("yes", "no", "maybe not", "it \"depends\"")

CONSTRAINTS = {
    "person": OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON)),
    "tags": OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(TAGS)),
    "regex": OutputConstraint(ConstraintKind.REGEX, REGEX),
    "grammar": OutputConstraint(ConstraintKind.GRAMMAR, GRAMMAR),
    "choice": OutputConstraint(ConstraintKind.CHOICE, choices=CHOICES),
    "object": OutputConstraint(ConstraintKind.JSON_OBJECT),
}
# These always finish by their grammar well within BOUNDED_MAX_TOKENS (a byte-level
# tokenizer needs at most a few tokens a character).
BOUNDED = ("person", "regex", "choice")
BOUNDED_MAX_TOKENS = 96
LARK = lark.Lark(GRAMMAR)


@pytest.fixture(scope="module")
def runner() -> Executor:
    return tiny_runner_for_tests()


@pytest.fixture(scope="module")
def detok(runner: Executor) -> Tokenizer:
    return Tokenizer.from_file(str(Path(runner.model_info.path) / "tokenizer.json"))


def constrained(rid: str, name: str, runner: Executor, seed: int, max_tokens: int = 48,
                **sampling: Any) -> Request:
    params = SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": max_tokens,
                               "constraint": CONSTRAINTS[name], **sampling})
    return Request(rid, list(prompt_of(6 + seed % 13, seed, runner.model_info.vocab_size)),
                   params, eos_token_ids=runner.model_info.eos_token_ids, session_id="s")


def run(runner: Executor, requests: list[Request], observer: Any = None,
        **config: Any) -> dict[str, list[RequestUpdate]]:
    core = EngineCore(EngineConfig(**config), runner)
    if observer is not None:
        core.observer = observer
    q = core.sessions.open("s")
    core.start()
    try:
        for r in requests:
            core.add_request(r)
        return collect(q, {r.request_id for r in requests}, timeout=60)[0]
    finally:
        core.shutdown()


def assert_valid(name: str, text: str) -> None:
    if name in ("person", "tags"):
        jsonschema.validate(json.loads(text), PERSON if name == "person" else TAGS)
    elif name == "object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "grammar":
        LARK.parse(text)
    else:
        assert text in CHOICES, text


@pytest.mark.timeout(240)
def test_hundreds_of_seeded_requests_follow_their_constraints(
        runner: Executor, detok: Tokenizer) -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny", 0, SchedulerStats, lambda: EngineState.RUNNING)
    names = list(CONSTRAINTS)
    requests = [constrained(f"r{i}", names[i % len(names)], runner, seed=i,
                            max_tokens=BOUNDED_MAX_TOKENS if names[i % len(names)] in BOUNDED
                            else 40)
                for i in range(360)]
    outputs = run(runner, requests, observer=metrics)
    finished_by_grammar = 0
    for r in requests:
        updates = outputs[r.request_id]
        name = next(n for n, c in CONSTRAINTS.items() if c == r.sampling.constraint)
        reason = updates[-1].finish_reason
        assert reason in (FinishReason.STOP, FinishReason.LENGTH), (r.request_id, updates[-1])
        if name in BOUNDED:
            assert reason is FinishReason.STOP, (r.request_id, name)
        if reason is FinishReason.STOP:
            finished_by_grammar += 1
            assert_valid(name, detok.decode(tokens(updates)))
    assert finished_by_grammar >= 200
    assert registry.get_sample_value(
        "corestream:constrained_requests_total", {"model_name": "tiny", "engine": "0"}) == 360
    # Six distinct constraints: each compiled once, the rest came from the cache.
    assert registry.get_sample_value(
        "corestream:grammar_compile_time_seconds_count",
        {"model_name": "tiny", "engine": "0"}) == len(CONSTRAINTS)
    assert registry.get_sample_value(
        "corestream:grammar_mask_time_seconds_count", {"model_name": "tiny", "engine": "0"}) > 0


@pytest.mark.timeout(120)
def test_unconstrained_outputs_are_unchanged_by_constrained_neighbours(
        runner: Executor) -> None:
    def free(i: int, **sampling: Any) -> Request:
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True,
                                   **sampling})
        return Request(f"free{i}", list(prompt_of(9 + i, 100 + i, runner.model_info.vocab_size)),
                       params, eos_token_ids=runner.model_info.eos_token_ids, session_id="s")

    def free_requests() -> list[Request]:
        return [free(0), free(1, temperature=0.8, seed=5), free(2, top_k=20, seed=9)]

    alone = run(runner, free_requests())
    mixed = run(runner, free_requests() + [
        constrained(f"c{i}", name, runner, seed=i) for i, name in enumerate(CONSTRAINTS)])
    for rid, updates in alone.items():
        assert tokens(mixed[rid]) == tokens(updates), rid


def exactness_requests(runner: Executor) -> list[Request]:
    return [constrained(f"x{i}", name, runner, seed=40 + i, max_tokens=32)
            for i, name in enumerate(list(CONSTRAINTS) * 2)]


def seen(outputs: dict[str, list[RequestUpdate]]) -> dict[str, tuple[list[int], Any]]:
    return {rid: (tokens(u), u[-1].finish_reason) for rid, u in outputs.items()}


@pytest.mark.timeout(180)
def test_preemption_chunked_prefill_batch_queue_and_prefix_cache_keep_outputs_exact(
        runner: Executor) -> None:
    baseline = seen(run(runner, exactness_requests(runner)))
    small = RecordingRunner(runner, num_blocks=14)  # forces preemptions
    assert seen(run(small, exactness_requests(runner))) == baseline  # type: ignore[arg-type]
    assert small.num_preemptions > 0
    assert seen(run(runner, exactness_requests(runner), max_num_batched_tokens=7)) == baseline
    assert seen(run(runner, exactness_requests(runner), max_concurrent_batches=2)) == baseline
    # The same requests again on a warm engine read their prompts from the prefix cache.
    warm = exactness_requests(runner)
    for r in warm:
        r.request_id += "-again"
    outputs, core = run_core(runner, exactness_requests(runner), warm)
    assert core.stats.prefix_cache_hits > 0
    assert seen({rid.removesuffix("-again"): u for rid, u in outputs.items()
                 if rid.endswith("-again")}) == baseline


@pytest.mark.timeout(60)
def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(
        runner: Executor, detok: Tokenizer) -> None:
    requests = [constrained(f"e{i}", "choice", runner, seed=i, ignore_eos=True, min_tokens=3)
                for i in range(8)]
    requests.append(constrained("cut", "tags", runner, seed=1, max_tokens=5))
    outputs = run(runner, requests)
    for r in requests[:-1]:
        assert outputs[r.request_id][-1].finish_reason is FinishReason.STOP
        assert detok.decode(tokens(outputs[r.request_id])) in CHOICES
    assert outputs["cut"][-1].finish_reason is FinishReason.LENGTH
    assert len(tokens(outputs["cut"])) == 5


@pytest.mark.timeout(60)
def test_logprobs_are_of_the_raw_distribution(runner: Executor, detok: Tokenizer) -> None:
    # The reported logprobs are before the mask: the constrained request reports the
    # same alternatives as an unconstrained one on the same prompt.
    request = constrained("lp", "regex", runner, seed=3, logprobs=5, temperature=0.0)
    unconstrained = Request("raw", list(request.prompt_token_ids), SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=5), session_id="s")
    outputs = run(runner, [request, unconstrained])
    first = outputs["lp"][0].new_logprobs[0]
    raw = outputs["raw"][0].new_logprobs[0]
    # Same prompt, same position: the same raw distribution...
    assert [t for t, _ in first.top] == [t for t, _ in raw.top]
    assert [lp for _, lp in first.top] == pytest.approx([lp for _, lp in raw.top], abs=1e-5)
    # ...though the constrained request took a token the regex allows (its first
    # character is one of a, b, c), which the raw argmax need not be.
    assert detok.decode([first.token_id])[:1] in "abc"
    assert first.rank >= 1 and first.logprob <= raw.top[0][1] + 1e-5


@pytest.mark.timeout(60)
def test_logit_bias_cannot_beat_the_mask(runner: Executor, detok: Tokenizer) -> None:
    z = detok.token_to_id("z")
    assert z is not None
    requests = [constrained(f"b{i}", "choice", runner, seed=i, logit_bias=((z, 1e6),))
                for i in range(4)]
    outputs = run(runner, requests)
    for r in requests:
        assert detok.decode(tokens(outputs[r.request_id])) in CHOICES


class GatedCompiler(GrammarCompiler):
    """The real compiler, held back until the test opens the gate: a slow compile on
    demand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _compile_pristine(self, constraint: OutputConstraint) -> Any:
        self.gate.wait(30)
        return super()._compile_pristine(constraint)


def gated_core(runner: Executor, **config: Any) -> tuple[EngineCore, GatedCompiler]:
    core = EngineCore(EngineConfig(**config), runner)
    compiler = GatedCompiler(runner.model_info)
    core.compiles.compiler = compiler
    return core, compiler


def free_request(runner: Executor, rid: str) -> Request:
    return Request(rid, list(prompt_of(8, 7, runner.model_info.vocab_size)),
                   SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   session_id="s")


@pytest.mark.timeout(60)
def test_a_compiling_request_holds_back_nobody_and_can_be_aborted(runner: Executor) -> None:
    core, compiler = gated_core(runner)
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(constrained("slow", "person", runner, seed=1,
                                     max_tokens=BOUNDED_MAX_TOKENS))
        core.add_request(constrained("aborted", "tags", runner, seed=2))
        core.add_request(free_request(runner, "free"))
        outputs = collect(q, {"free"}, timeout=30)[0]
        assert len(tokens(outputs["free"])) == 6  # done while both still compile
        core.abort_requests(["aborted"])
        aborted = collect(q, {"aborted"}, timeout=30)[0]["aborted"]
        assert aborted[-1].finish_reason is FinishReason.ABORT and not tokens(aborted)
        compiler.gate.set()
        slow = collect(q, {"slow"}, timeout=30)[0]["slow"]
        assert slow[-1].finish_reason is FinishReason.STOP
        assert core.stats.num_running == 0 and not core.compiles
    finally:
        compiler.gate.set()
        core.shutdown()


@pytest.mark.timeout(60)
def test_a_compile_past_the_timeout_fails_only_its_request(runner: Executor) -> None:
    core, compiler = gated_core(runner, grammar_compile_timeout_s=0.3)
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(constrained("slow", "person", runner, seed=1))
        core.add_request(free_request(runner, "free"))
        outputs = collect(q, {"slow", "free"}, timeout=30)[0]
        slow = outputs["slow"]
        assert slow[-1].finish_reason is FinishReason.ERROR and not tokens(slow)
        assert slow[-1].error_code == INVALID_ARGUMENT
        assert "sampling.json_schema" in slow[-1].error_message
        assert "grammar_compile_timeout_s (0.3 s)" in slow[-1].error_message
        assert len(tokens(outputs["free"])) == 6
        compiler.gate.set()  # the late compile is dropped; the engine serves on
        core.add_request(constrained("after", "choice", runner, seed=3))
        after = collect(q, {"after"}, timeout=30)[0]["after"]
        assert after[-1].finish_reason is FinishReason.STOP
    finally:
        compiler.gate.set()
        core.shutdown()


@pytest.mark.timeout(60)
def test_a_constraint_that_does_not_compile_fails_alone(runner: Executor) -> None:
    # The frontend refuses these; an engine reached directly must too, and serve on.
    bad = [
        ("regex", OutputConstraint(ConstraintKind.REGEX, "a(b")),
        ("json_schema", OutputConstraint(ConstraintKind.JSON_SCHEMA, "{not json")),
        ("json_schema", OutputConstraint(ConstraintKind.JSON_SCHEMA,
                                         '{"type": "array", "uniqueItems": true}')),
        ("grammar", OutputConstraint(ConstraintKind.GRAMMAR, "start: undefined_rule")),
        ("choice", OutputConstraint(ConstraintKind.CHOICE)),
    ]
    requests = [Request(f"bad{i}", [5, 6, 7], SamplingParams(max_tokens=4, constraint=c),
                        session_id="s") for i, (_, c) in enumerate(bad)]
    outputs = run(runner, [*requests, free_request(runner, "free")])
    for i, (field, _) in enumerate(bad):
        last = outputs[f"bad{i}"][-1]
        assert last.finish_reason is FinishReason.ERROR and last.error_code == INVALID_ARGUMENT
        assert f"sampling.{field}" in last.error_message, last.error_message
        assert not tokens(outputs[f"bad{i}"])
    assert len(tokens(outputs["free"])) == 6


class LockstepTinyRunner:
    """The real tiny runner stepping in lockstep with another rank (see
    test_engine_waves.py): every forward, real or dummy, meets the other rank's."""

    def __init__(self, runner: Executor, barrier: threading.Barrier, votes: list[bool],
                 rank: int) -> None:
        self.runner, self.barrier, self.votes, self.rank = runner, barrier, votes, rank
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size
        self.model_info = runner.model_info

    def execute(self, out: Any) -> Any:
        self.barrier.wait(20)
        return self.runner.execute(out)

    def close(self) -> None:
        pass  # the module's tests share the wrapped runner

    def describe_stall(self) -> str:
        return ""

    def execute_dummy(self) -> None:
        self.barrier.wait(20)

    def any_rank_has_work(self, has_work: bool) -> bool:
        self.votes[self.rank] = has_work
        self.barrier.wait(20)
        result = any(self.votes)
        self.barrier.wait(20)
        return result


@pytest.mark.timeout(120)
def test_constrained_outputs_are_exact_in_lockstep_waves(runner: Executor) -> None:
    baseline = seen(run(runner, exactness_requests(runner)))
    barrier, votes = threading.Barrier(2), [False, False]
    ranks = [LockstepTinyRunner(r, barrier, votes, i)
             for i, r in enumerate((runner, tiny_runner_for_tests()))]
    cores = [EngineCore(EngineConfig(engine_index=i), ranks[i]) for i in range(2)]  # type: ignore[arg-type]
    for core in cores:
        core.join_waves(check_interval=4,
                        announce=lambda wave: [c.start_wave(wave) for c in cores])  # type: ignore[arg-type]
    q = cores[0].sessions.open("s")
    for core in cores:
        core.start()
    try:
        requests = exactness_requests(runner)
        for r in requests:
            cores[0].add_request(r)
        assert seen(collect(q, {r.request_id for r in requests}, timeout=60)[0]) == baseline
    finally:
        barrier.abort()
        for core in cores:
            core.shutdown()
