"""Speculation under an output constraint: drafts the grammar rejects are cut before
the step, each position is masked as its grammar stands after the drafts before it,
and the outputs are those without speculation, valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from services.common.constraints import ConstraintKind, OutputConstraint
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.executor.protocol import Executor
from services.engine.request import FinishReason, Request, RequestUpdate
from services.engine.speculative.speculator import SpeculationStats
from tests.unit.engine.fakes import collect, prompt_of, tiny_runner_for_tests, tokens

TAGS = {"type": "object", "properties": {"tags": {
    "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6}},
    "required": ["tags"]}
REGEX = r"(ab|abc|b){10,30}"
CONSTRAINTS = {
    "tags": OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(TAGS)),
    "regex": OutputConstraint(ConstraintKind.REGEX, REGEX),
}
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 4, "min_acceptance_rate": 0.0,
                   "disable_by_batch_size": 64})


@pytest.fixture(scope="module")
def runner() -> Executor:
    return tiny_runner_for_tests()


def requests(runner: Executor) -> list[Request]:
    out = []
    for i in range(24):
        name = "tags" if i % 2 else "regex"
        params = SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, seed=i,
                                max_tokens=120, constraint=CONSTRAINTS[name])
        out.append(Request(f"{name}{i}", list(prompt_of(5 + i, i, runner.model_info.vocab_size)),
                           params, eos_token_ids=runner.model_info.eos_token_ids,
                           session_id="s"))
    return out


def run(runner: Executor, config: EngineConfig,
        ) -> tuple[dict[str, list[RequestUpdate]], SpeculationStats | None]:
    core = EngineCore(config, runner)
    q = core.sessions.open("s")
    core.start()
    try:
        reqs = requests(runner)
        for r in reqs:
            core.add_request(r)
        return collect(q, {r.request_id for r in reqs}, timeout=120)[0], \
            core.scheduler.stats().speculation
    finally:
        core.shutdown()


@pytest.mark.timeout(300)
def test_constrained_outputs_equal_those_without_speculation_and_stay_valid(
        runner: Executor) -> None:
    plain, _ = run(runner, EngineConfig())
    spec, stats = run(runner, EngineConfig(speculative_config=SPEC))
    assert stats is not None and stats.num_drafts > 20 and stats.num_accepted_tokens > 0
    detok = Tokenizer.from_file(str(Path(runner.model_info.path) / "tokenizer.json"))
    for rid, updates in plain.items():
        assert tokens(spec[rid]) == tokens(updates), rid
        assert spec[rid][-1].finish_reason is updates[-1].finish_reason
        if updates[-1].finish_reason is FinishReason.STOP:
            text = detok.decode(tokens(updates))
            if rid.startswith("tags"):
                jsonschema.validate(json.loads(text), TAGS)
            else:
                assert re.fullmatch(REGEX, text), text
