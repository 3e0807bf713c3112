from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from google.protobuf import json_format
from pydantic import ValidationError

from services.frontend.errors import RequestError
from services.frontend.openai_api.schemas import (
    ChatCompletionBody,
    CompletionBody,
    chat_request,
    completion_requests,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _completion(**fields: Any) -> CompletionBody:
    return CompletionBody.model_validate({"model": "m", "prompt": "hi", **fields})


def _chat(**fields: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _sampling(**fields: Any) -> common_pb2.SamplingParams:
    [request] = completion_requests(_completion(**fields))
    return request.sampling


def _refused(call: Any, field: str, words: str) -> None:
    with pytest.raises(RequestError) as caught:
        call()
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == field
    assert words in caught.value.message


# (body fields, the SamplingParams they give, as json_format writes it) for fields that
# both APIs map the same way.
SHARED_SAMPLING: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"temperature": 0.5}, {"temperature": 0.5}),
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"top_p": 0.25}, {"topP": 0.25}),
    ({"top_k": 5}, {"topK": 5}),
    ({"top_k": -1}, {"topK": -1}),
    ({"seed": 2**40}, {"seed": str(2**40)}),
    ({"seed": -3}, {"seed": "-3"}),
    ({"n": 3}, {"n": 3}),
    ({"stop": "x"}, {"stop": ["x"]}),
    ({"stop": ["x", "yz"]}, {"stop": ["x", "yz"]}),
    ({"stop": None}, {}),
    ({"stop_token_ids": [7, 9]}, {"stopTokenIds": [7, 9]}),
    ({"ignore_eos": True}, {"ignoreEos": True}),
    ({"include_stop_str_in_output": True}, {"includeStopStrInOutput": True}),
    ({"min_tokens": 2}, {"minTokens": 2}),
    ({"min_p": 0.125}, {"minP": 0.125}),
    ({"repetition_penalty": 1.5}, {"repetitionPenalty": 1.5}),
    ({"presence_penalty": -0.5}, {"presencePenalty": -0.5}),
    ({"frequency_penalty": 1.25}, {"frequencyPenalty": 1.25}),
    ({"logit_bias": {"5": 2.5, "17": -100}}, {"logitBias": {"5": 2.5, "17": -100.0}}),
    # OpenAI clients send null for "not given".
    ({"temperature": None, "top_p": None, "n": None, "seed": None}, {}),
]


@pytest.mark.parametrize(("fields", "expected"), SHARED_SAMPLING)
def test_completion_sampling_fields(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    sampling = _sampling(**fields)
    assert json_format.MessageToDict(sampling) == {"maxTokens": 16, **expected}


@pytest.mark.parametrize(("fields", "expected"), SHARED_SAMPLING)
def test_chat_sampling_fields(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    sampling = chat_request(_chat(**fields)).sampling
    assert json_format.MessageToDict(sampling) == expected


def test_unset_fields_stay_unset_for_the_server_defaults() -> None:
    sampling = chat_request(_chat()).sampling
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "n",
                 "logprobs", "prompt_logprobs"):
        assert not sampling.HasField(name), name
    assert sampling.WhichOneof("constraint") is None


@pytest.mark.parametrize(("fields", "max_tokens"), [
    ({}, 16),  # OpenAI's default for completions
    ({"max_tokens": 5}, 5),
    ({"max_tokens": None}, None),  # as many as fit
])
def test_completion_max_tokens(fields: dict[str, Any], max_tokens: int | None) -> None:
    sampling = _sampling(**fields)
    assert (sampling.max_tokens if sampling.HasField("max_tokens") else None) == max_tokens


@pytest.mark.parametrize(("fields", "max_tokens"), [
    ({}, None),  # up to the context
    ({"max_tokens": 5}, 5),
    ({"max_completion_tokens": 7}, 7),
    ({"max_tokens": 5, "max_completion_tokens": 7}, 7),
    ({"max_tokens": 5, "max_completion_tokens": None}, 5),
])
def test_chat_max_tokens(fields: dict[str, Any], max_tokens: int | None) -> None:
    sampling = chat_request(_chat(**fields)).sampling
    assert (sampling.max_tokens if sampling.HasField("max_tokens") else None) == max_tokens


@pytest.mark.parametrize(("fields", "logprobs"), [
    ({}, None),
    ({"logprobs": 0}, 0),
    ({"logprobs": 5}, 5),
    ({"logprobs": None}, None),
])
def test_completion_logprobs(fields: dict[str, Any], logprobs: int | None) -> None:
    sampling = _sampling(**fields)
    assert (sampling.logprobs if sampling.HasField("logprobs") else None) == logprobs


@pytest.mark.parametrize(("fields", "logprobs"), [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 3}, 3),
    # top_logprobs 0 asks for no alternatives: harmless without logprobs.
    ({"logprobs": False, "top_logprobs": 0}, None),
])
def test_chat_logprobs(fields: dict[str, Any], logprobs: int | None) -> None:
    sampling = chat_request(_chat(**fields)).sampling
    assert (sampling.logprobs if sampling.HasField("logprobs") else None) == logprobs


def test_chat_top_logprobs_needs_logprobs() -> None:
    _refused(lambda: chat_request(_chat(top_logprobs=2)), "top_logprobs", "logprobs: true")


def test_completion_request_fields() -> None:
    [request] = completion_requests(_completion(
        skip_special_tokens=False, priority=-3, cache_salt="tenant", request_id="mine",
        prompt_logprobs=2, user="u"))
    assert request.skip_special_tokens is False and request.HasField("skip_special_tokens")
    assert request.priority == -3
    assert request.cache_salt == "tenant"
    assert request.sampling.prompt_logprobs == 2
    # The app chooses the ids (one per prompt).
    assert request.request_id == ""


def test_completion_request_defaults() -> None:
    [request] = completion_requests(_completion())
    assert not request.HasField("skip_special_tokens")
    assert (request.priority, request.cache_salt, request.request_id) == (0, "", "")
    assert not request.sampling.HasField("prompt_logprobs")


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", [("text", "hello")]),
    (["a", "b c"], [("text", "a"), ("text", "b c")]),
    ([1, 2, 3], [("token_ids", [1, 2, 3])]),
    ([[1, 2], [3]], [("token_ids", [1, 2]), ("token_ids", [3])]),
])
def test_completion_prompt_forms(prompt: Any, expected: list[tuple[str, Any]]) -> None:
    requests = completion_requests(_completion(prompt=prompt, n=2, temperature=0.5))
    got = []
    for request in requests:
        kind = request.WhichOneof("prompt")
        got.append((kind, request.text if kind == "text" else list(request.token_ids.ids)))
        # Every prompt's request carries all the sampling fields.
        assert request.sampling.n == 2 and request.sampling.temperature == 0.5
    assert got == expected


@pytest.mark.parametrize(("prompt", "field"), [
    ("", "prompt"),
    ([], "prompt"),
    (["a", ""], "prompt[1]"),
    ([[1], []], "prompt[1]"),
])
def test_completion_empty_prompts(prompt: Any, field: str) -> None:
    _refused(lambda: completion_requests(_completion(prompt=prompt)), field, "empty")


# (completion body fields, the constraint oneof field, its value)
COMPLETION_CONSTRAINTS: list[tuple[dict[str, Any], str, Any]] = [
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": "start: 'x'"}, "grammar", "start: 'x'"),
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "a|b"}}, "regex", "a|b"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", ["a"]),
    ({"structured_outputs": {"grammar": "g"}}, "grammar", "g"),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
]


@pytest.mark.parametrize(("fields", "kind", "value"), COMPLETION_CONSTRAINTS)
def test_completion_constraints(fields: dict[str, Any], kind: str, value: Any) -> None:
    sampling = _sampling(**fields)
    assert sampling.WhichOneof("constraint") == kind
    got: Any = getattr(sampling, kind)
    if kind == "json_schema":
        got = json.loads(got)
    elif kind == "choice":
        got = list(got.choices)
    assert got == value


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}},
    {"structured_outputs": {"json_object": False}},
    {"structured_outputs": {}},
])
def test_completion_no_constraint(fields: dict[str, Any]) -> None:
    assert _sampling(**fields).WhichOneof("constraint") is None


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_regex", "guided_json, guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice",
     "response_format, guided_choice"),
    ({"structured_outputs": {"regex": "x", "grammar": "g"}}, "structured_outputs.grammar",
     "structured_outputs.regex, structured_outputs.grammar"),
    ({"guided_grammar": "g", "structured_outputs": {"json": SCHEMA}},
     "structured_outputs.json", "at most one output constraint"),
])
def test_two_constraint_sources_are_refused(fields: dict[str, Any], field: str,
                                            words: str) -> None:
    _refused(lambda: completion_requests(_completion(**fields)), field, words)
    _refused(lambda: chat_request(_chat(**fields)), field, words)


@pytest.mark.parametrize(("response_format", "field"), [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
])
def test_json_schema_format_needs_a_schema(response_format: dict[str, Any], field: str) -> None:
    _refused(lambda: completion_requests(_completion(response_format=response_format)),
             field, "required")
    _refused(lambda: chat_request(_chat(response_format=response_format)), field, "required")


def test_structural_tag_is_refused() -> None:
    _refused(lambda: completion_requests(_completion(structured_outputs={"structural_tag": {}})),
             "structured_outputs.structural_tag", "not supported")


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"echo": True}, "echo", "not supported"),
    ({"suffix": "tail"}, "suffix", "not supported"),
    ({"best_of": 2}, "best_of", "must equal n (1)"),
    ({"best_of": 3, "n": 2}, "best_of", "must equal n (2)"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "'abc' is not a token id"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias", "not a token id"),
    ({"logit_bias": {str(2**32): 1.0}}, "logit_bias", "not a token id"),
])
def test_completion_refusals(fields: dict[str, Any], field: str, words: str) -> None:
    _refused(lambda: completion_requests(_completion(**fields)), field, words)


@pytest.mark.parametrize("fields", [
    {"echo": False}, {"suffix": ""}, {"suffix": None}, {"best_of": 1}, {"best_of": 2, "n": 2},
    {"prompt_logprobs": 1, "stream": False},
])
def test_completion_accepted_neutral_values(fields: dict[str, Any]) -> None:
    assert len(completion_requests(_completion(**fields))) == 1


# (body, the pydantic error's loc)
BAD_TYPES: list[tuple[type[CompletionBody] | type[ChatCompletionBody], dict[str, Any],
                      tuple[Any, ...]]] = [
    (CompletionBody, {"prompt": "x"}, ("model",)),
    (CompletionBody, {"model": "m"}, ("prompt",)),
    (CompletionBody, {"model": "m", "prompt": "x", "temperature": "hot"}, ("temperature",)),
    (CompletionBody, {"model": "m", "prompt": "x", "max_tokens": 2**31}, ("max_tokens",)),
    (CompletionBody, {"model": "m", "prompt": "x", "logprobs": 21}, ("logprobs",)),
    (CompletionBody, {"model": "m", "prompt": "x", "stop_token_ids": [1, -2]},
     ("stop_token_ids", 1)),
    (CompletionBody, {"model": "m", "prompt": "x", "logit_bias": {"1": "much"}},
     ("logit_bias", "1")),
    (CompletionBody, {"model": "m", "prompt": "x", "response_format": {"type": "yaml"}},
     ("response_format", "type")),
    (CompletionBody, {"model": "m", "prompt": "x", "stream_options": {"include_usage": "?"}},
     ("stream_options", "include_usage")),
    (ChatCompletionBody, {"model": "m"}, ("messages",)),
    (ChatCompletionBody, {"model": "m", "messages": [{"content": "x"}]}, ("messages", 0, "role")),
    (ChatCompletionBody, {"model": "m", "messages": [{"role": "user", "content": 5}]},
     ("messages", 0, "content")),
    (ChatCompletionBody, {"model": "m", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     ("messages", 0, "tool_calls", 0, "function", "name")),
    (ChatCompletionBody, {"model": "m", "messages": [], "top_logprobs": 21}, ("top_logprobs",)),
    (ChatCompletionBody, {"model": "m", "messages": [], "tools": [{"function": {}}]},
     ("tools", 0, "function", "name")),
    (ChatCompletionBody, {"model": "m", "messages": [], "chat_template_kwargs": [1]},
     ("chat_template_kwargs",)),
]


@pytest.mark.parametrize(("model", "body", "loc"), BAD_TYPES)
def test_bad_types_name_the_field(model: type[CompletionBody] | type[ChatCompletionBody],
                                  body: dict[str, Any], loc: tuple[Any, ...]) -> None:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    locs = [error["loc"] for error in caught.value.errors()]
    # A union reports one error per member, each loc starting with the field's path.
    assert any(got[:len(loc)] == loc for got in locs), locs


@pytest.mark.parametrize("prompt", [[1, "a"], [[1], ["a"]], [-1], 5, [[2**32]]])
def test_bad_prompts(prompt: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionBody.model_validate({"model": "m", "prompt": prompt})
    assert all(error["loc"][0] == "prompt" for error in caught.value.errors())


def test_unknown_fields_are_ignored() -> None:
    body = _chat(metadata={"k": "v"}, store=False, service_tier="auto", frobnicate=1)
    assert chat_request(body).messages[0].content == "hi"
    assert len(completion_requests(_completion(frobnicate=1))) == 1


def test_include_usage() -> None:
    assert not _completion().include_usage
    assert not _completion(stream=True, stream_options={}).include_usage
    assert _chat(stream=True, stream_options={"include_usage": True}).include_usage


def _messages(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    request = chat_request(_chat(messages=list(messages)))
    return [json_format.MessageToDict(m) for m in request.messages]


# (OpenAI message, the ChatMessage it gives, as json_format writes it)
MESSAGES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"role": "system", "content": "be brief"}, {"role": "system", "content": "be brief"}),
    ({"role": "developer", "content": "x", "name": "ops"},
     {"role": "developer", "content": "x", "name": "ops"}),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
     {"role": "user", "contentParts": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]}),
    ({"role": "user", "content": None}, {"role": "user"}),
    ({"role": "assistant"}, {"role": "assistant"}),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get", "arguments": "{\"city\": \"Oslo\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "put", "arguments": "{}"}}]},
     {"role": "assistant", "toolCalls": [
         {"id": "call_1", "name": "get", "arguments": "{\"city\": \"Oslo\"}"},
         {"id": "call_2", "name": "put", "arguments": "{}"}]}),
    # Arguments pass through as written; the server checks them.
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
     {"role": "assistant", "toolCalls": [{"name": "f", "arguments": "not json"}]}),
    ({"role": "tool", "content": "12C", "tool_call_id": "call_1"},
     {"role": "tool", "content": "12C", "toolCallId": "call_1"}),
    ({"role": "assistant", "content": "4", "reasoning_content": "2+2"},
     {"role": "assistant", "content": "4", "reasoning": "2+2"}),
    ({"role": "assistant", "content": "4", "reasoning": "2+2"},
     {"role": "assistant", "content": "4", "reasoning": "2+2"}),
    ({"role": "assistant", "content": "4", "reasoning": "2+2", "reasoning_content": "2+2"},
     {"role": "assistant", "content": "4", "reasoning": "2+2"}),
]


@pytest.mark.parametrize(("message", "expected"), MESSAGES)
def test_message_forms(message: dict[str, Any], expected: dict[str, Any]) -> None:
    assert _messages(message) == [expected]


@pytest.mark.parametrize(("message", "field", "words"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "messages[1].content[0].type", "only \"text\""),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[1].content[0].text", "missing"),
    ({"role": "assistant", "reasoning": "a", "reasoning_content": "b"},
     "messages[1].reasoning", "differ"),
])
def test_message_refusals(message: dict[str, Any], field: str, words: str) -> None:
    body = _chat(messages=[{"role": "user", "content": "x"}, message])
    _refused(lambda: chat_request(body), field, words)


def test_chat_request_fields() -> None:
    tools = [
        {"type": "function", "function": {"name": "get", "description": "Get it.",
                                          "parameters": SCHEMA, "strict": True}},
        {"type": "function", "function": {"name": "ping"}},
    ]
    request = chat_request(_chat(
        tools=tools, parallel_tool_calls=False, chat_template="{{ x }}",
        chat_template_kwargs={"enable_thinking": False, "depth": {"n": [1, "a"]}},
        add_generation_prompt=False, continue_final_message=True, priority=4,
        cache_salt="s", request_id="mine", skip_special_tokens=True))
    assert [(t.name, t.description) for t in request.tools] == [("get", "Get it."),
                                                                ("ping", "")]
    assert json.loads(request.tools[0].parameters) == SCHEMA
    assert request.tools[1].parameters == ""
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    assert request.chat_template == "{{ x }}"
    assert json_format.MessageToDict(request.chat_template_kwargs) == {
        "enable_thinking": False, "depth": {"n": [1.0, "a"]}}
    assert request.HasField("add_generation_prompt") and not request.add_generation_prompt
    assert request.continue_final_message
    assert (request.priority, request.cache_salt, request.request_id) == (4, "s", "")


def test_chat_request_defaults() -> None:
    request = chat_request(_chat())
    assert not request.HasField("tool_choice")
    assert not request.HasField("parallel_tool_calls")
    assert not request.HasField("add_generation_prompt")
    assert not request.HasField("chat_template_kwargs")
    assert not request.HasField("response_format")
    assert (request.chat_template, request.continue_final_message) == ("", False)


@pytest.mark.parametrize(("tool_choice", "expected"), [
    ("auto", {"mode": "TOOL_CHOICE_MODE_AUTO"}),
    ("none", {"mode": "TOOL_CHOICE_MODE_NONE"}),
    ("required", {"mode": "TOOL_CHOICE_MODE_REQUIRED"}),
    ({"type": "function", "function": {"name": "get"}}, {"function": "get"}),
])
def test_tool_choice(tool_choice: Any, expected: dict[str, Any]) -> None:
    request = chat_request(_chat(tool_choice=tool_choice))
    assert json_format.MessageToDict(request.tool_choice) == expected


def test_bad_tool_choice() -> None:
    with pytest.raises(ValidationError) as caught:
        _chat(tool_choice="sometimes")
    assert all(error["loc"][0] == "tool_choice" for error in caught.value.errors())


# (chat body fields, the response_format type, its schema)
CHAT_FORMATS: list[tuple[dict[str, Any], int, Any]] = [
    ({"response_format": {"type": "text"}}, chat_pb2.RESPONSE_FORMAT_TYPE_TEXT, None),
    ({"response_format": {"type": "json_object"}}, chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT,
     None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, SCHEMA),
    ({"guided_json": SCHEMA}, chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json_object": True}}, chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT,
     None),
]


@pytest.mark.parametrize(("fields", "kind", "schema"), CHAT_FORMATS)
def test_chat_response_format(fields: dict[str, Any], kind: int, schema: Any) -> None:
    request = chat_request(_chat(**fields))
    assert request.response_format.type == kind
    assert (json.loads(request.response_format.json_schema)
            if request.response_format.json_schema else None) == schema
    # The chat servicer refuses a sampling constraint.
    assert request.sampling.WhichOneof("constraint") is None


@pytest.mark.parametrize(("fields", "field"), [
    ({"guided_regex": "x"}, "guided_regex"),
    ({"guided_choice": ["a"]}, "guided_choice"),
    ({"guided_grammar": "g"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "x"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "g"}}, "structured_outputs.grammar"),
])
def test_chat_refuses_constraints_without_a_response_format(fields: dict[str, Any],
                                                            field: str) -> None:
    _refused(lambda: chat_request(_chat(**fields)), field, "use response_format")
