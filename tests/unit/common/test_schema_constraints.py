"""JSON Schemas as real users send them (tests/data/schemas/): which are followed
exactly, which are approximated with the output checked after generation, which are
refused, and where; the oneOf disjointness proof on its own."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from services.common.constraints import (
    CheckedConstraint,
    ConstraintError,
    ConstraintKind,
    OutputConstraint,
    check_constraint,
    compile_matcher,
    llguidance_grammar,
)
from services.common.schema_support import Draft, _Resolver, disjoint, exact_one_of
from services.frontend.generate.constraint_check import OutputCheck
from tests.data.schemas.cases import CASES, Case

by_name = pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])


def constraint(schema: Any) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def compact(value: Any) -> str:
    """JSON as the grammar writes it (", " and ": ")."""
    return json.dumps(value, ensure_ascii=False)


def grammar_accepts(checked: CheckedConstraint, tokenizer: llguidance.LLTokenizer,
                    value: Any) -> bool:
    """Whether the engines' grammar takes the value's text token by token to its end."""
    matcher = compile_matcher(llguidance_grammar(checked.engine), tokenizer)
    for token in tokenizer.tokenize_str(compact(value)):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


def test_the_corpus_is_what_it_says() -> None:
    names = {case.name for case in CASES}
    assert {"kubernetes_like", "function_shape_discriminated", "function_contact_overlap",
            "config_not", "tree_dynamic_ref"} <= names
    kubernetes = next(case for case in CASES if case.name == "kubernetes_like")
    assert len(json.dumps(kubernetes.schema)) >= 200_000
    for case in CASES:
        validator = jsonschema.validators.validator_for(case.schema)(case.schema)
        for value in case.valid:
            validator.validate(value)
        for value in case.invalid:
            assert not validator.is_valid(value), (case.name, value)


@by_name
def test_default_mode_serves_or_refuses_as_documented(
    case: Case, tokenizer: llguidance.LLTokenizer
) -> None:
    if case.verdict == "refused":
        with pytest.raises(ConstraintError) as info:
            check_constraint(constraint(case.schema), tokenizer)
        assert case.refusal in str(info.value)
        return
    checked = check_constraint(constraint(case.schema), tokenizer)
    noted = tuple(sorted(note.split(" at ", 1)[1].split(" ", 1)[0] for note in checked.notes))
    assert noted == tuple(sorted(case.relaxed))
    assert checked.relaxed == tuple(p.rsplit("/", 1)[-1] for p in noted)
    if case.verdict == "exact":
        assert checked.output_schema is None
    else:
        assert checked.output_schema == case.schema
    # What the engines get compiles with no warning at all (their compile is strict).
    compile_matcher(llguidance_grammar(checked.engine), tokenizer)


@by_name
def test_strict_mode_refuses_every_approximation_by_its_pointer(
    case: Case, tokenizer: llguidance.LLTokenizer
) -> None:
    if case.strict == "accepted":
        assert check_constraint(constraint(case.schema), tokenizer, strict=True).notes == ()
        return
    with pytest.raises(ConstraintError) as info:
        check_constraint(constraint(case.schema), tokenizer, strict=True)
    for where in case.relaxed:
        assert f"at {where}" in str(info.value)


@by_name
def test_grammar_and_output_check_together_accept_exactly_the_valid_examples(
    case: Case, tokenizer: llguidance.LLTokenizer
) -> None:
    if case.verdict == "refused":
        pytest.skip("refused")
    checked = check_constraint(constraint(case.schema), tokenizer)
    check = None if checked.output_schema is None else OutputCheck(checked.output_schema)
    for value in case.valid:
        # The grammar never rules out a valid output, approximated or not.
        assert grammar_accepts(checked, tokenizer, value), value
        assert check is None or check.failure(compact(value)) is None
    for value in case.invalid:
        followed = grammar_accepts(checked, tokenizer, value)
        if check is None:
            assert not followed, value  # exact: the grammar alone rules it out
        else:
            assert not followed or check.failure(compact(value)) is not None, value


def test_output_check_says_why() -> None:
    check = OutputCheck({"type": "object", "properties": {"a": {"not": {"const": 1}}}})
    assert check.failure('{"a": 2}') is None
    failure = check.failure('{"a": 1}')
    assert failure is not None and "$.a" in failure and "/properties/a/not" in failure
    assert "not JSON" in (check.failure('{"a": ') or "")


def test_pointers_escape_and_property_names_are_not_keywords(
    tokenizer: llguidance.LLTokenizer
) -> None:
    schema = {"type": "object", "properties": {
        "not": {"type": "string"},  # a property named "not" stays
        "a/b~c": {"type": "string", "not": {"const": "x"}}}}
    checked = check_constraint(constraint(schema), tokenizer)
    assert checked.relaxed == ("not",)
    assert "at /properties/a~1b~0c/not " in checked.notes[0]
    assert json.loads(checked.engine.spec)["properties"]["not"] == {"type": "string"}


def test_an_exact_schema_reaches_the_engines_unchanged(
    tokenizer: llguidance.LLTokenizer
) -> None:
    original = constraint({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert check_constraint(original, tokenizer).engine is original


def test_a_badly_formed_dropped_keyword_is_refused(tokenizer: llguidance.LLTokenizer) -> None:
    # Nothing but the output check would read it, too late to refuse the request.
    with pytest.raises(ConstraintError, match="uniqueItems at /uniqueItems is not valid"):
        check_constraint(constraint({"type": "array", "uniqueItems": "yes"}), tokenizer)


def test_deeply_nested_json_is_refused_not_a_crash(tokenizer: llguidance.LLTokenizer) -> None:
    spec = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ConstraintError, match="nested too deeply"):
        check_constraint(OutputConstraint(ConstraintKind.JSON_SCHEMA, spec), tokenizer)


def obj(required: list[str] | None = None, closed: bool = False, **properties: Any) -> Any:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        schema["required"] = required
    if closed:
        schema["additionalProperties"] = False
    return schema


PROVED = [
    ("types", {"type": "string"}, {"type": ["integer", "null"]}),
    ("true is not 1", {"const": True}, {"const": 1}),
    ("enums", {"enum": ["a", "b"]}, {"enum": ["c"]}),
    ("const discriminator required by one",
     obj(["k"], k={"const": "a"}), obj(None, k={"const": "b"})),
    ("required here, forbidden there",
     obj(["r"], r={"type": "number"}), obj(["w"], closed=True, w={"type": "number"})),
    ("property false", obj(["r"]), obj(None, r=False)),
    ("through $ref", {"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}),
    ("through allOf", {"allOf": [{"$ref": "#/$defs/a"}]}, {"$ref": "#/$defs/b"}),
    ("nested discriminator", obj(["x"], x=obj(["t"], t={"const": 1})),
     obj(["x"], x=obj(["t"], t={"const": 2}))),
]
NOT_PROVED = [
    ("integer within number", {"type": "integer"}, {"type": "number"}),
    ("1 equals 1.0", {"const": 1}, {"const": 1.0}),
    ("discriminator required by neither", obj(None, k={"const": "a"}), obj(None, k={"const": "b"})),
    ("different required, open objects", obj(["r"]), obj(["w"])),
    ("patternProperties may allow it", obj(["r"]),
     {"type": "object", "patternProperties": {"^r": {}}, "additionalProperties": False}),
    ("null in both", {"type": ["string", "null"]}, {"type": ["integer", "null"]}),
    ("a cycle ends", {"$ref": "#/$defs/loop"}, {"$ref": "#/$defs/loop"}),
]
DEFS = {"$defs": {"a": obj(["k"], k={"const": "a"}), "b": obj(["k"], k={"const": "b"}),
                  "loop": {"$ref": "#/$defs/loop"}}}


@pytest.mark.parametrize(("a", "b"), [case[1:] for case in PROVED],
                         ids=[case[0] for case in PROVED])
def test_disjoint_branches_are_proved(a: Any, b: Any) -> None:
    resolve = _Resolver(DEFS)
    assert disjoint(a, b, resolve) and disjoint(b, a, resolve)


@pytest.mark.parametrize(("a", "b"), [case[1:] for case in NOT_PROVED],
                         ids=[case[0] for case in NOT_PROVED])
def test_overlapping_branches_are_not(a: Any, b: Any) -> None:
    assert not disjoint(a, b, _Resolver(DEFS))


def test_proved_oneofs_become_anyof_in_a_copy() -> None:
    schema = {"oneOf": [{"type": "string"}, {"type": "integer"}],
              "anyOf": [{"minLength": 1}, {"minimum": 0}],
              "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    before = json.dumps(schema)
    draft = Draft(schema)
    unproved = exact_one_of(draft)
    assert json.dumps(schema) == before
    assert [draft.pointer_of(node, "oneOf") for node in unproved] == ["/properties/x/oneOf"]
    # Beside an anyOf of its own, the rewritten oneOf goes into allOf: both must hold.
    assert draft.schema["anyOf"] == schema["anyOf"]
    assert draft.schema["allOf"] == [{"anyOf": schema["oneOf"]}]


@pytest.mark.parametrize("uri", ["https://json-schema.org/draft-07/schema",
                                 "http://json-schema.org/schema#",
                                 "http://json-schema.org/draft/2019-09/schema#"])
def test_a_draft_spelt_another_way_is_read_as_that_draft(
    uri: str, tokenizer: llguidance.LLTokenizer
) -> None:
    # llguidance knows each draft's metaschema by one URI and refuses others it cannot
    # fetch; a sixth of the SchemaStore schemas it refused were only that.
    schema = {"$schema": uri, "type": "object", "properties": {"a": {"not": {"const": 1}}}}
    checked = check_constraint(constraint(schema), tokenizer)
    engine_uri = json.loads(checked.engine.spec)["$schema"]
    assert engine_uri.startswith(("http://json-schema.org/draft-0", "https://json-schema.org/draft/"))
    assert checked.output_schema is not None and checked.output_schema["$schema"] == engine_uri
    assert OutputCheck(checked.output_schema).failure('{"a": 1}') is not None


def test_an_unknown_dialect_is_refused_by_name(tokenizer: llguidance.LLTokenizer) -> None:
    # Snowplow's self-describing schemas name a metaschema of their own.
    uri = "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#"
    with pytest.raises(ConstraintError, match="iglucentral"):
        check_constraint(constraint({"$schema": uri, "type": "object"}), tokenizer)


def test_a_reference_into_a_group_of_definitions_is_walked(
    tokenizer: llguidance.LLTokenizer
) -> None:
    # "definitions/common" is a map of schemas, not a schema: only the $ref reaches it.
    schema = {"type": "object", "properties": {"agents": {"$ref": "#/definitions/common/agents"}},
              "definitions": {"common": {"agents": {"type": "array", "uniqueItems": True,
                                                    "items": {"type": "string"}}}}}
    checked = check_constraint(constraint(schema), tokenizer)
    assert checked.relaxed == ("uniqueItems",)
    assert "at /definitions/common/agents/uniqueItems " in checked.notes[0]
