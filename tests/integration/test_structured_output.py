"""Structured output through the real cluster (`corestream serve`, two engines, the
built-in tiny random-weight model), checked with independent validators: jsonschema
for schemas, Python's `re` for regexes, a real Lark parser for grammars.

The random weights never produce valid output by themselves, so every valid output
here is the constraint's mask at work. The constraints are bounded (enums, maxLength,
integer ranges, no additional properties) so that greedy and seeded outputs end by
the constraint (FINISH_REASON_STOP) well within max_tokens; the tests check that they
do rather than validating whatever happens to fit.

The real-world-like schemas of tests/data/schemas/ (a 200k-character Kubernetes-like
manifest, oneOf with and without a discriminator, not, if/then, ...) go through the
cluster too: exact ones end valid; approximated ones carry warnings, and each output
that ends either validates (FINISH_REASON_STOP) or is reported as failing
(FINISH_REASON_SCHEMA_MISMATCH), which jsonschema confirms.

One cluster serves the whole module (its start counts against the first test's
timeout), with the default size limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import jsonschema
import lark
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.frontend.config import FrontendConfig
from tests.data.schemas.cases import CASES, Case
from tests.integration.cluster import Cluster

# Covers the cluster's start (the first test pays it) plus a test's own requests.
TIMEOUT_S = 240
MAX_CONSTRAINT_CHARS = FrontendConfig().max_constraint_chars
NUM_ENGINES = 2
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
MISMATCH = common_pb2.FINISH_REASON_SCHEMA_MISMATCH
# Far above what any bounded constraint below needs (the longest takes about 60).
MAX_TOKENS = 256

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        # An unknown format is ignored (jsonschema ignores it too).
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4,
                                            "format": "x-corestream-tag"}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", "maybe", 'say "hi"', "back\\slash", "two\nlines", "é")
LARK_GRAMMAR = """\
start: greeting " " name "!"
greeting: "hello" | "hi" | "hey"
name: /[a-z]{1,8}/
"""
GBNF_GRAMMAR = 'root ::= ("yes" | "no") " " [0-9]'
# The same language as GBNF_GRAMMAR, for Lark to check it.
GBNF_AS_LARK = 'start: ("yes" | "no") " " /[0-9]/'


def assert_compact_json(text: str) -> None:
    """No whitespace outside strings but the single space of ", " and ": "."""
    skeleton = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    assert re.fullmatch(r"(?:[^\s,:]|[,:] )*", skeleton), f"not compact: {text!r}"


def valid_schema_output(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)
    assert_compact_json(text)


def valid_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)
    assert_compact_json(text)


def valid_regex_output(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def valid_choice(text: str) -> None:
    assert text in CHOICES


def lark_validator(grammar: str) -> Callable[[str], None]:
    parser = lark.Lark(grammar)

    def check(text: str) -> None:
        parser.parse(text)  # raises lark.exceptions.LarkError unless text is a sentence

    return check


@dataclass(frozen=True)
class Kind:
    name: str
    constraint: dict[str, Any]
    """The SamplingParams constraint field and its value."""
    check: Callable[[str], None]
    """Raises unless the text follows the constraint."""


KINDS = [
    Kind("json_schema", {"json_schema": json.dumps(SCHEMA)}, valid_schema_output),
    Kind("regex", {"regex": REGEX}, valid_regex_output),
    Kind("grammar_lark", {"grammar": LARK_GRAMMAR}, lark_validator(LARK_GRAMMAR)),
    Kind("grammar_gbnf", {"grammar": GBNF_GRAMMAR}, lark_validator(GBNF_AS_LARK)),
    Kind("choice", {"choice": common_pb2.ChoiceConstraint(choices=CHOICES)}, valid_choice),
    Kind("json_object", {"json_object": True}, valid_json_object),
]
# json_object may go on for as long as the model likes when sampled; the others end.
BOUNDED_KINDS = [kind for kind in KINDS if kind.name != "json_object"]


def by_name(kinds: list[Kind]) -> Any:
    return pytest.mark.parametrize("kind", kinds, ids=[kind.name for kind in kinds])


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--engines", str(NUM_ENGINES)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster: Cluster) -> Iterator[pb_grpc.GenerateServiceStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerateServiceStub(channel)


def sampling(constraint: dict[str, Any], max_tokens: int = MAX_TOKENS,
             **kwargs: Any) -> common_pb2.SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return common_pb2.SamplingParams(max_tokens=max_tokens, **constraint, **kwargs)


def generate(stub: pb_grpc.GenerateServiceStub, params: common_pb2.SamplingParams,
             text: str = "tell me about yourself", **kwargs: Any) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(text=text, sampling=params, **kwargs), timeout=60)


def stream(stub: pb_grpc.GenerateServiceStub, params: common_pb2.SamplingParams,
           text: str = "tell me about yourself") -> dict[int, tuple[str, list[int], int]]:
    """Each sample's (text, token ids, finish reason) from GenerateStream."""
    samples: dict[int, tuple[str, list[int], int]] = {}
    request = pb.GenerateStreamRequest(text=text, sampling=params)
    for chunk in stub.GenerateStream(request, timeout=60):
        sample_text, token_ids, _ = samples.get(chunk.index, ("", [], 0))
        samples[chunk.index] = (sample_text + chunk.text, token_ids + list(chunk.token_ids),
                                chunk.finish_reason)
    return samples


def assert_valid(kind: Kind, completion: pb.Completion) -> None:
    assert completion.finish_reason == STOP, (
        f"{kind.name} did not end by its constraint within {MAX_TOKENS} tokens: "
        f"{completion.text!r} ({common_pb2.FinishReason.Name(completion.finish_reason)})")
    kind.check(completion.text)


@pytest.mark.timeout(TIMEOUT_S)
@by_name(KINDS)
def test_generate_and_stream_follow_the_constraint(
    stub: pb_grpc.GenerateServiceStub, kind: Kind
) -> None:
    params = sampling(kind.constraint)
    (completion,) = generate(stub, params).completions
    assert_valid(kind, completion)
    assert 0 < len(completion.token_ids) < MAX_TOKENS

    (streamed,) = stream(stub, params).values()
    assert streamed == (completion.text, list(completion.token_ids), STOP)


@pytest.mark.timeout(TIMEOUT_S)
def test_validators_reject_unconstrained_output(stub: pb_grpc.GenerateServiceStub) -> None:
    # Without a mask the random weights follow none of the constraints, so the valid
    # outputs in the other tests are the mask's doing.
    (free,) = generate(stub, sampling({}, max_tokens=32, ignore_eos=True)).completions
    for kind in KINDS:
        with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError,
                            lark.exceptions.LarkError)):
            kind.check(free.text)


@pytest.mark.timeout(TIMEOUT_S)
@by_name(BOUNDED_KINDS)
def test_seeded_samples_are_each_constrained(
    stub: pb_grpc.GenerateServiceStub, kind: Kind
) -> None:
    params = sampling(kind.constraint, temperature=1.0, seed=11, n=2)
    response = generate(stub, params)
    assert len(response.completions) == 2
    for completion in response.completions:
        assert_valid(kind, completion)
    # The seed reproduces both samples, streamed as well.
    assert stream(stub, params) == {
        i: (c.text, list(c.token_ids), STOP) for i, c in enumerate(response.completions)}


@pytest.mark.timeout(TIMEOUT_S)
@by_name(KINDS)
def test_both_engines_give_the_same_valid_output(
    stub: pb_grpc.GenerateServiceStub, kind: Kind
) -> None:
    params = sampling(kind.constraint)
    completions = [generate(stub, params, text="a pinned request", data_parallel_rank=rank)
                   .completions[0] for rank in range(NUM_ENGINES)]
    for completion in completions:
        assert_valid(kind, completion)
    assert len({(c.text, tuple(c.token_ids)) for c in completions}) == 1


@pytest.mark.timeout(TIMEOUT_S)
def test_max_tokens_cuts_a_constrained_output(stub: pb_grpc.GenerateServiceStub) -> None:
    (completion,) = generate(stub, sampling(KINDS[0].constraint, max_tokens=3)).completions
    assert completion.finish_reason == LENGTH
    assert len(completion.token_ids) == 3
    # Cut inside the one prefix the schema allows.
    prefix = '{"name": "'
    assert completion.text.startswith(prefix) or prefix.startswith(completion.text)


@pytest.mark.timeout(TIMEOUT_S)
def test_logprobs_are_of_the_unmasked_distribution(stub: pb_grpc.GenerateServiceStub) -> None:
    # The first position sees the same context with or without a constraint, so its
    # raw alternatives are the same; the digit the regex forces is rarely the best.
    def first_position(constraint: dict[str, Any]) -> common_pb2.PositionLogprobs:
        params = sampling(constraint, max_tokens=3, logprobs=5)
        return generate(stub, params, data_parallel_rank=0).completions[0].logprobs[0]

    free, forced = first_position({}), first_position({"regex": "[0-9]{3}"})
    assert [t.token_id for t in forced.top] == [t.token_id for t in free.top]
    assert [t.logprob for t in forced.top] == pytest.approx([t.logprob for t in free.top],
                                                            abs=1e-4)
    assert forced.token.isdigit()
    assert forced.logprob <= forced.top[0].logprob
    assert forced.rank > 1  # the tiny model's best first token is not a digit


def schema_with(**keywords: Any) -> str:
    return json.dumps({"type": "array", "items": {"type": "integer"}, **keywords})


# The regex [00...0-9]{3}: a character class padded with repeats up to `size` characters.
def padded_regex(size: int) -> str:
    return "[" + "0" * (size - len("[0-9]{3}")) + "0-9]{3}"


BAD_CONSTRAINTS = [
    ("schema_not_json", {"json_schema": '{"type": "object",'}, "not valid JSON"),
    ("schema_not_an_object", {"json_schema": "[1, 2]"}, "object or a boolean"),
    ("regex_unparsable", {"regex": "[0-9"}, "unclosed character class"),
    ("grammar_unparsable", {"grammar": "start: (\"a\" | \"b\""}, "sampling.grammar"),
    ("grammar_no_start", {"grammar": 'greeting: "hello"'}, "sampling.grammar"),
    # Not a mere narrowing, so refused even though outputs are checked: by its pointer.
    ("dynamic_ref", {"json_schema": schema_with(items={"$dynamicRef": "#x"})},
     "unsupported keyword $dynamicRef at /items/$dynamicRef"),
    ("contains_malformed", {"json_schema": schema_with(contains=5)},
     "contains at /contains is not valid"),
    ("choice_empty", {"choice": common_pb2.ChoiceConstraint()}, "empty"),
    ("choice_empty_string", {"choice": common_pb2.ChoiceConstraint(choices=["a", ""])},
     "empty string"),
    ("regex_too_long", {"regex": padded_regex(MAX_CONSTRAINT_CHARS + 1)},
     "max_constraint_chars"),
    ("choices_too_long", {"choice": common_pb2.ChoiceConstraint(
        choices=["x" * (MAX_CONSTRAINT_CHARS // 2), "y" * (MAX_CONSTRAINT_CHARS // 2 + 1)])},
     "max_constraint_chars"),
]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("constraint", "reason"), [case[1:] for case in BAD_CONSTRAINTS],
                         ids=[case[0] for case in BAD_CONSTRAINTS])
def test_bad_constraint_is_invalid_argument_naming_the_field(
    stub: pb_grpc.GenerateServiceStub, constraint: dict[str, Any], reason: str
) -> None:
    (field_name,) = constraint
    field = f"sampling.{field_name}"
    params = sampling(constraint, max_tokens=8)
    for call in (lambda: generate(stub, params), lambda: stream(stub, params)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason in err.value.details()
        status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
        assert status is not None
        bad_request = error_details_pb2.BadRequest()
        assert status.details[0].Unpack(bad_request)
        assert bad_request.field_violations[0].field == field
        assert field in bad_request.field_violations[0].description
    # The next request is served as usual.
    (completion,) = generate(stub, sampling({}, max_tokens=4, ignore_eos=True)).completions
    assert completion.finish_reason == LENGTH and len(completion.token_ids) == 4


@pytest.mark.timeout(TIMEOUT_S)
def test_constraint_at_the_size_limit_is_served(stub: pb_grpc.GenerateServiceStub) -> None:
    regex = padded_regex(MAX_CONSTRAINT_CHARS)
    assert len(regex) == MAX_CONSTRAINT_CHARS
    (completion,) = generate(stub, sampling({"regex": regex})).completions
    assert completion.finish_reason == STOP
    assert re.fullmatch(regex, completion.text)


SERVED = [case for case in CASES if case.verdict != "refused"]


def consistent(case: Case, completion: pb.Completion) -> None:
    """An output that ends is valid exactly when the server says so."""
    if completion.finish_reason == LENGTH:
        return
    value = json.loads(completion.text)
    assert_compact_json(completion.text)
    valid = jsonschema.validators.validator_for(case.schema)(case.schema).is_valid(value)
    if completion.finish_reason == STOP:
        assert valid, completion.text
    else:
        assert completion.finish_reason == MISMATCH and case.verdict == "approximated"
        assert not valid, completion.text


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("case", SERVED, ids=[case.name for case in SERVED])
def test_real_world_schemas_are_served_as_documented(
    stub: pb_grpc.GenerateServiceStub, case: Case
) -> None:
    params = sampling({"json_schema": json.dumps(case.schema)}, temperature=1.0, seed=3, n=4)
    response = generate(stub, params)
    pointers = sorted(w.split(" at ", 1)[1].split(" ", 1)[0] for w in response.warnings)
    assert pointers == sorted(case.relaxed)
    for completion in response.completions:
        consistent(case, completion)
    # Unbounded strings and numbers let a sample run to max_tokens now and then; the
    # others end, and are checked.
    assert any(c.finish_reason != LENGTH for c in response.completions)
    # The stream carries the warnings once, in its first chunk.
    chunks = list(stub.GenerateStream(pb.GenerateStreamRequest(
        text="tell me about yourself", sampling=params), timeout=60))
    assert list(chunks[0].warnings) == list(response.warnings)
    assert not any(chunk.warnings for chunk in chunks[1:])


@pytest.mark.timeout(TIMEOUT_S)
def test_an_approximated_oneof_reports_the_outputs_that_fail(
    stub: pb_grpc.GenerateServiceStub
) -> None:
    # "b" is in both branches' enums: anyOf allows it, oneOf does not.
    case = next(c for c in CASES if c.name == "enum_overlap")
    params = sampling({"json_schema": json.dumps(case.schema)}, temperature=1.0, seed=5,
                      n=16)
    completions = generate(stub, params).completions
    for completion in completions:
        consistent(case, completion)
    texts = {c.finish_reason: c.text for c in completions}
    assert texts.get(MISMATCH) == '"b"' and texts.get(STOP) in ('"a"', '"c"')
