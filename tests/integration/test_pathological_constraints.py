"""Pathological output constraints through a real cluster: $ref cycles, 10,000-deep
schemas, huge enums and alternations, patterns that are catastrophic for backtracking
regex engines, huge patterns. Each is refused with a client error naming the field, or
compiled and served, within a bound; a normal request sent while it is handled stays
prompt; nothing dies.

Three kinds of constraint compile but hit one of llguidance's limits while the answer
is generated (its parser's row size, its lexer's expression count, and a mask that
allows a special token whose text the grammar spells out). The engine's scheduler then
ends the request (services/engine/scheduler/scheduler.py, `_append`) with
INVALID_ARGUMENT naming the constraint's field; it used to be INTERNAL.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2

from tests.integration.cluster import Cluster, alive

pytestmark = pytest.mark.timeout(300)

# Generous for two busy cores: each case takes well under a second alone, the widest
# (3000 branches) about three.
MAX_SECONDS = 20.0
PROMPT_SECONDS = 10.0
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
DEEP = 10_000


def deep_items(depth: int) -> str:
    # Written as text: json.dumps itself cannot encode 10,000 levels.
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


def deep_properties(depth: int) -> str:
    return ('{"type":"object","required":["a"],"properties":{"a":' * depth
            + '{"type":"string"}' + "}}" * depth)


def wide(keyword: str, n: int) -> dict[str, Any]:
    return {keyword: [{"type": "object", "properties": {f"k{i}": {"const": i}},
                       "required": [f"k{i}"]} for i in range(n)]}


SCHEMAS: dict[str, str] = {
    "self $ref": json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    "mutual $ref": json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                              "b": {"$ref": "#/$defs/a"}}}),
    "root $ref": json.dumps({"type": "object", "properties": {"x": {"$ref": "#"}}}),
    "dangling $ref": json.dumps({"$ref": "#/$defs/missing"}),
    "recursive anyOf": json.dumps({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"},
                                                             {"type": "null"}]}},
                                   "$ref": "#/$defs/a"}),
    "200-deep items": deep_items(200),
    "10,000-deep items": deep_items(DEEP),
    "10,000-deep properties": deep_properties(DEEP),
    "100,000-value enum": json.dumps({"enum": [f"v{i}" for i in range(100_000)]}),
    "50,000-int enum": json.dumps({"enum": list(range(50_000))}),
    "(a+)+$ pattern": json.dumps({"type": "string", "pattern": "^(a+)+$"}),
    "(a|a)*b pattern": json.dumps({"type": "string", "pattern": "(a|a)*b"}),
    "(x+x+)+y pattern": json.dumps({"type": "string", "pattern": "(x+x+)+y"}),
    "DFA blow-up pattern": json.dumps({"type": "string", "pattern": "(a|b)*a(a|b){40}"}),
    "200,000-char pattern": json.dumps({"type": "string", "pattern": "a" * 200_000}),
    "30,000-way alternation": json.dumps(
        {"type": "string", "pattern": "|".join(f"w{i}" for i in range(30_000))}),
    "billion minLength": json.dumps({"type": "string", "minLength": 10**9}),
    "million minItems": json.dumps({"type": "array", "items": {"type": "integer"},
                                    "minItems": 10**6}),
}
# Limits hit during generation (see the module's docstring).
WIDE_SCHEMAS = {"3000-branch anyOf": json.dumps(wide("anyOf", 3000)),
                "3000-branch oneOf": json.dumps(wide("oneOf", 3000))}
REGEXES = {
    "(a+)+$": "(a+)+$", "(a|aa)+$": "(a|aa)+$", "DFA blow-up": "(a|b)*a(a|b){40}",
    "200,000 chars": "a" * 200_000, "[a-z]{1,100000}": "[a-z]{1,100000}",
    "backreference": r"(a)\1", "unclosed": "(a",
}
LIMIT_REGEXES = {"(a{1000}){1000}": "(a{1000}){1000}"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--engines", "1", "--max-tokens-limit", "4"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield ch


def _sampling(**constraint: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=4, temperature=0.0, **constraint)


def _chat(schema: str, how: str) -> chat_pb2.ChatRequest:
    request = chat_pb2.ChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="hi")], sampling=_sampling())
    if how == "response_format":
        request.response_format.type = chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA
        request.response_format.json_schema = schema
    else:
        # A tool's parameters are an object schema: the schema under one property.
        # (Text, not json.loads: the deep ones cannot be loaded here either.)
        request.tools.add(name="f", parameters=(
            '{"type":"object","required":["p"],"properties":{"p":' + schema + "}}"))
        request.tool_choice.mode = chat_pb2.TOOL_CHOICE_MODE_REQUIRED
    return request


def judged(channel: grpc.Channel, send: Any) -> tuple[grpc.StatusCode, str, float]:
    """The call's code and message, with a normal request sent while it runs: that one
    must answer within PROMPT_SECONDS (the frontend and engine are not stuck)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            send()
            outcome["code"], outcome["details"] = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            outcome["code"], outcome["details"] = e.code(), e.details() or ""
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    start = time.monotonic()
    reply = pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
        text="hello", sampling=_sampling(ignore_eos=True)), timeout=PROMPT_SECONDS)
    assert len(reply.completions[0].token_ids) == 4
    assert time.monotonic() - start < PROMPT_SECONDS
    thread.join(MAX_SECONDS + 60)
    assert not thread.is_alive()
    return outcome["code"], outcome["details"], outcome["seconds"]


def check(cluster: Cluster, code: grpc.StatusCode, details: str, seconds: float,
          *fields: str) -> None:
    """Served, or refused with a client error whose message names one of `fields`."""
    assert seconds < MAX_SECONDS, f"took {seconds:.1f} s"
    assert code is grpc.StatusCode.OK or code in CLIENT_ERRORS, f"{code}: {details[:2000]}"
    if code is not grpc.StatusCode.OK:
        assert any(field in details for field in fields), details
    assert cluster.proc.poll() is None and alive(cluster.engine_pid(0)), cluster.output()


@pytest.mark.parametrize("how", ["response_format", "tool"])
@pytest.mark.parametrize("schema", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_chat_schema_refused_or_served(cluster: Cluster, channel: grpc.Channel, schema: str,
                                       how: str) -> None:
    chat = chat_grpc.ChatServiceStub(channel)
    code, details, seconds = judged(channel, lambda: chat.Chat(_chat(schema, how),
                                                               timeout=MAX_SECONDS + 30))
    # A tool's schema is also written into the prompt, where a huge one passes the
    # context: that refusal names the prompt.
    fields = ("response_format",) if how != "tool" else ("tools", "prompt")
    check(cluster, code, details, seconds, *fields)


# GenerateService's json_schema takes the same check as response_format: the deep
# ones (parsed by each door itself) suffice there.
DEEP_SCHEMAS = {k: v for k, v in SCHEMAS.items() if "deep" in k}


@pytest.mark.parametrize("schema", DEEP_SCHEMAS.values(), ids=DEEP_SCHEMAS.keys())
def test_generate_schema_refused_or_served(cluster: Cluster, channel: grpc.Channel,
                                           schema: str) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    code, details, seconds = judged(channel, lambda: stub.Generate(pb.GenerateRequest(
        text="hi", sampling=_sampling(json_schema=schema)), timeout=MAX_SECONDS + 30))
    check(cluster, code, details, seconds, "json_schema")


@pytest.mark.parametrize("regex", REGEXES.values(), ids=REGEXES.keys())
def test_regex_refused_or_served(cluster: Cluster, channel: grpc.Channel, regex: str) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    code, details, seconds = judged(channel, lambda: stub.Generate(pb.GenerateRequest(
        text="hi", sampling=_sampling(regex=regex)), timeout=MAX_SECONDS + 30))
    check(cluster, code, details, seconds, "regex")


def test_deep_tool_arguments_in_history_are_refused(channel: grpc.Channel) -> None:
    # Regression: json.loads' RecursionError on a 10,000-deep document escaped as UNKNOWN.
    deep = "[" * DEEP + "]" * DEEP
    request = chat_pb2.ChatRequest(messages=[
        chat_pb2.ChatMessage(role="user", content="hi"),
        chat_pb2.ChatMessage(role="assistant", tool_calls=[chat_pb2.ToolCall(
            id="c1", name="f", arguments='{"a":' + deep + "}")]),
        chat_pb2.ChatMessage(role="tool", tool_call_id="c1", content="ok")],
        sampling=_sampling())
    with pytest.raises(grpc.RpcError) as caught:
        chat_grpc.ChatServiceStub(channel).Chat(request, timeout=60)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "arguments" in (caught.value.details() or "")


def test_deep_kv_transfer_params_json_is_refused(channel: grpc.Channel) -> None:
    # Regression: the vLLM door's kv_transfer_params_json had the same RecursionError.
    request = vllm_engine_pb2.GenerateRequest(
        request_id="deep", text="hi", kv_transfer_params_json="[" * DEEP + "]" * DEEP)
    request.sampling_params.max_tokens = 1
    call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate",
                                vllm_engine_pb2.GenerateRequest.SerializeToString,
                                vllm_engine_pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as caught:
        list(call(request, timeout=60))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transfer_params_json" in (caught.value.details() or "")


@pytest.mark.parametrize("schema", WIDE_SCHEMAS.values(), ids=WIDE_SCHEMAS.keys())
def test_wide_schema_error_is_readable(cluster: Cluster, channel: grpc.Channel,
                                       schema: str) -> None:
    # Regression: the engine's error carried llguidance's state and whole grammar
    # (228 KB), past gRPC's metadata limit, so the client saw only its own library's
    # RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit").
    chat = chat_grpc.ChatServiceStub(channel)
    code, details, seconds = judged(channel, lambda: chat.Chat(
        _chat(schema, "response_format"), timeout=MAX_SECONDS + 30))
    assert seconds < MAX_SECONDS
    assert "metadata" not in details and len(details) < 2000, details[:300]
    assert cluster.proc.poll() is None and alive(cluster.engine_pid(0))


LIMIT_CASES = {
    **{f"response_format {k}": ("chat", v) for k, v in WIDE_SCHEMAS.items()},
    **{f"regex {k}": ("regex", v) for k, v in LIMIT_REGEXES.items()},
    "choice of a special token's text": ("choice", "<s>"),
}


@pytest.mark.parametrize(("kind", "spec"), LIMIT_CASES.values(), ids=LIMIT_CASES.keys())
def test_grammar_limits_hit_while_generating_are_client_errors(
        cluster: Cluster, channel: grpc.Channel, kind: str, spec: str) -> None:
    if kind == "chat":
        send = lambda: chat_grpc.ChatServiceStub(channel).Chat(  # noqa: E731
            _chat(spec, "response_format"), timeout=MAX_SECONDS + 30)
    else:
        sampling = (_sampling(regex=spec) if kind == "regex" else
                    _sampling(choice=common_pb2.ChoiceConstraint(choices=[spec])))
        send = lambda: pb_grpc.GenerateServiceStub(channel).Generate(  # noqa: E731
            pb.GenerateRequest(text="0", sampling=sampling), timeout=MAX_SECONDS + 30)
    code, details, seconds = judged(channel, send)
    # The engine names the constraint's field: a chat's response_format is its
    # json_schema.
    check(cluster, code, details, seconds, "json_schema" if kind == "chat" else kind)
