"""Constraints to llguidance grammars: what is accepted, what is refused and why."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
from corestream.common.v1 import common_pb2
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from services.common.constraints import (
    ConstraintError,
    ConstraintKind,
    OutputConstraint,
    build_tokenizer,
    compile_matcher,
    llguidance_grammar,
)
from services.common.convert import sampling_from_proto, sampling_to_proto
from services.common.model_info import load_model_info
from services.common.tiny_checkpoint import resolve_model


def schema(s: object) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(s))


def force(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    """Whether the grammar accepts `text` token by token and is then complete."""
    for token in tokenizer.tokenize_str(text):
        if not matcher.consume_token(token):
            return False
    return bool(matcher.is_accepting())


@pytest.mark.parametrize("constraint, accepted, refused", [
    (schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     '{"a": 12}', '{"a":12}'),  # compact with ", " / ": ", and only that
    (schema({"type": "array", "items": {"enum": ["x", "y"]}}), '["x", "y"]', '["x",  "y"]'),
    (OutputConstraint(ConstraintKind.JSON_OBJECT), '{"k": [1, 2]}', '[1, 2]'),
    (OutputConstraint(ConstraintKind.JSON_SCHEMA, "true"), '[1, {"a": null}]', "[1,2]"),
    (OutputConstraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    (OutputConstraint(ConstraintKind.GRAMMAR, 'start: "a" b+\nb: "b"'), "abbb", "aab"),
    # GBNF is accepted too.
    (OutputConstraint(ConstraintKind.GRAMMAR, 'root ::= "x" [0-9]+'), "x42", "y42"),
    (OutputConstraint(ConstraintKind.CHOICE, choices=('say "hi"', "a\\b", "new\nline")),
     "a\\b", "a"),
    (OutputConstraint(ConstraintKind.CHOICE, choices=('say "hi"', "a\\b")), 'say "hi"', "say"),
])
def test_grammars_accept_exactly_their_language(
        tokenizer: llguidance.LLTokenizer, constraint: OutputConstraint, accepted: str,
        refused: str) -> None:
    grammar = llguidance_grammar(constraint)
    assert force(compile_matcher(grammar, tokenizer), tokenizer, accepted)
    assert not force(compile_matcher(grammar, tokenizer), tokenizer, refused)


@pytest.mark.parametrize("constraint, reason", [
    (OutputConstraint(ConstraintKind.JSON_SCHEMA, "{not json"), "is not valid JSON"),
    (OutputConstraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), "an object or a boolean"),
    (OutputConstraint(ConstraintKind.JSON_SCHEMA, "false"), "accepts no value"),
    (OutputConstraint(ConstraintKind.GRAMMAR, "  "), "the grammar is empty"),
    (schema({"type": "strin"}), "strin"),
    (schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (schema({"not": {"type": "string"}}), "not"),
    (schema({"if": {"type": "string"}, "then": {"minLength": 2}}), "if"),
    (OutputConstraint(ConstraintKind.REGEX, "a(b"), "unclosed group"),
    (OutputConstraint(ConstraintKind.GRAMMAR, "start: nowhere"), "nowhere"),
    (OutputConstraint(ConstraintKind.CHOICE), "empty"),
    (OutputConstraint(ConstraintKind.CHOICE, choices=("a", "")), "empty string"),
])
def test_what_cannot_be_followed_exactly_is_refused_with_the_reason(
        tokenizer: llguidance.LLTokenizer, constraint: OutputConstraint, reason: str) -> None:
    with pytest.raises(ConstraintError, match=reason):
        compile_matcher(llguidance_grammar(constraint), tokenizer)


def test_unknown_formats_are_annotations_and_ignored(tokenizer: llguidance.LLTokenizer) -> None:
    constraint = schema({"type": "string", "format": "x-company-id", "maxLength": 3})
    assert force(compile_matcher(llguidance_grammar(constraint), tokenizer), tokenizer, '"ab"')


def test_ids_past_the_tokenizer_are_never_allowed(tokenizer: llguidance.LLTokenizer) -> None:
    info = load_model_info(resolve_model(None))
    padded = build_tokenizer((resolve_model(None) / "tokenizer.json").read_text(),
                             info.vocab_size + 40, info.eos_token_ids)
    matcher = compile_matcher(llguidance_grammar(OutputConstraint(ConstraintKind.JSON_OBJECT)),
                              padded)
    bitmask = allocate_token_bitmask(1, info.vocab_size + 40)
    fill_next_token_bitmask(matcher, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    assert bits[:info.vocab_size].any() and not bits[info.vocab_size:info.vocab_size + 40].any()


@pytest.mark.parametrize("field, value, expected", [
    ("json_schema", '{"type": "integer"}',
     OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}')),
    ("regex", "a+", OutputConstraint(ConstraintKind.REGEX, "a+")),
    ("grammar", 'start: "a"', OutputConstraint(ConstraintKind.GRAMMAR, 'start: "a"')),
    ("json_object", True, OutputConstraint(ConstraintKind.JSON_OBJECT)),
    ("json_object", False, None),
])
def test_the_constraint_round_trips_through_the_wire(field: str, value: object,
                                                     expected: OutputConstraint | None) -> None:
    pb = common_pb2.SamplingParams(**{field: value})
    params = sampling_from_proto(pb)
    assert params.constraint == expected
    assert sampling_from_proto(sampling_to_proto(params)) == params


def test_choices_round_trip_through_the_wire() -> None:
    pb = common_pb2.SamplingParams(choice=common_pb2.ChoiceConstraint(choices=["a", "b c"]))
    params = sampling_from_proto(pb)
    assert params.constraint == OutputConstraint(ConstraintKind.CHOICE, choices=("a", "b c"))
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert params.constraint.field == "sampling.choice" and params.constraint.size == 4
