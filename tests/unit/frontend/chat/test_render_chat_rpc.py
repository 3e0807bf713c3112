"""The RenderChat RPC against transformers' apply_chat_template on real published templates.

test_template.py checks `render_chat` on dicts; this sends the same corpus over
gRPC to a real FrontendServer, so that the proto conversion (request.py) is part
of what must agree: each conversation becomes ChatMessage / Tool protos, and the
RPC's prompt and token ids must equal what transformers renders from the dicts on
the same tokenizer. Where transformers refuses, the RPC answers INVALID_ARGUMENT.

Some conversations of the corpus have no exact proto form (`_why_unsendable` says
which and why); they are left out, and each template must still compare at least
`MIN_COMPARED` renders so that the test cannot pass by comparing nothing.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import jinja2
import pytest
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.common.model_info import ModelInfo
from services.frontend.chat.request import _FUNCTION_NAME, ROLES
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer
from tests.unit.frontend.chat.template_corpus import (
    CASES,
    CHECKPOINTS,
    EXPECTED_REFUSALS,
    Case,
    Pair,
    variants,
)

# Renders each template must compare (text and ids), refusals not counted.
MIN_COMPARED = 30
# Of the corpus, at most this many conversations may be left out as unsendable.
MAX_UNSENDABLE = 2


def _renamed_tool(case: Case, name: str) -> Case:
    assert case.tools is not None and len(case.tools) == 1
    tool = copy.deepcopy(case.tools[0])
    tool["function"]["name"] = name
    return Case(case.messages, [tool])


# The corpus, plus its unicode conversation with a tool name ChatService accepts (the
# original's "übersetze" is refused), so that its non-ASCII content, description and
# markup are compared over the RPC too.
RPC_CASES: dict[str, Case] = {
    **CASES,
    "unicode_and_markup_ascii_tool": _renamed_tool(CASES["unicode_and_markup"], "uebersetze"),
}

# ---- what a ChatMessage / Tool can carry ---------------------------------------------

_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
# Proto strings have no "absent": the servicer leaves these out when empty, so only a
# non-empty string (or no key) has an exact proto form.
_OPTIONAL_STRINGS = ("name", "tool_call_id", "reasoning_content")
_TOOL_FIELDS = {"name", "description", "parameters"}
# Function fields outside the OpenAI tool schema (the corpus's `return`): the proto,
# like the OpenAI API, has no place for them, so both sides get the tools without them.
_TOOL_FIELDS_DROPPED = ("return",)


def _why_unsendable(case: Case) -> str | None:
    """Why `case` has no exact proto form (the RPC would see another conversation), or
    None when it has one (up to `_TOOL_FIELDS_DROPPED`).

    - content must be a string: ChatMessage.content is one, so None (OpenAI's `content:
      null` next to tool calls) arrives as "", and parts arrive as their joined text;
    - no message keys beyond ChatMessage's fields, and its optional strings non-empty;
    - a role the servicer accepts (others are refused before any template runs);
    - tool calls as {"id"?, "type": "function", "function": {"name", "arguments": object}}:
      arguments travel as JSON text and come back as an object, so arguments given as a
      string would reach the template as an object;
    - tools as {"type": "function", "function": {name, description?, parameters?}} with a
      non-empty description if any (an empty one is left out) and parameters, if given,
      as an object.
    Dict key order is not carried either (the servicer builds its own dicts); no template
    here serializes a whole message, call or tool function with it.
    """
    for i, message in enumerate(case.messages):
        where = f"messages[{i}]"
        extra = set(message) - _MESSAGE_FIELDS
        if extra:
            return f"{where} has {sorted(extra)}, which ChatMessage has no field for"
        if message.get("role") not in ROLES:
            return f"{where}.role {message.get('role')!r} is refused by the servicer"
        if not isinstance(message.get("content"), str):
            return f"{where}.content is {message.get('content')!r}, not a string"
        for key in _OPTIONAL_STRINGS:
            if key in message and not (isinstance(message[key], str) and message[key]):
                return f"{where}.{key} is {message[key]!r}; only a non-empty string is kept"
        if "tool_calls" in message:
            calls = message["tool_calls"]
            if not calls:
                return f"{where}.tool_calls is empty, which the proto cannot tell from absent"
            for j, call in enumerate(calls):
                reason = _why_call_unsendable(call)
                if reason:
                    return f"{where}.tool_calls[{j}] {reason}"
    for i, tool in enumerate(case.tools or []):
        function = tool.get("function", {})
        if tool.get("type") != "function" or set(tool) != {"type", "function"}:
            return f"tools[{i}] is not a plain function tool"
        if set(function) - _TOOL_FIELDS - set(_TOOL_FIELDS_DROPPED):
            return f"tools[{i}].function has fields Tool cannot carry"
        if "description" in function and not function["description"]:
            return f"tools[{i}].function.description is empty"
        if not isinstance(function.get("parameters", {}), dict):
            return f"tools[{i}].function.parameters is not given as an object"
        if not _FUNCTION_NAME.fullmatch(function.get("name", "")):
            # ChatService takes only OpenAI function names (the tool-call grammars rely
            # on it); the plan checks that it refuses them, and `RPC_CASES` sends the
            # conversation again with an ASCII name.
            return f"tools[{i}] is named {function.get('name')!r}, outside [A-Za-z0-9_.-]"
    return None


def _why_call_unsendable(call: dict[str, Any]) -> str | None:
    function = call.get("function")
    if call.get("type") != "function" or set(call) - {"id", "type", "function"}:
        return "is not a plain function call"
    if "id" in call and not (isinstance(call["id"], str) and call["id"]):
        return "has an empty id"
    if not isinstance(function, dict) or set(function) != {"name", "arguments"}:
        return "has function fields other than name and arguments"
    if not isinstance(function["arguments"], dict):
        return "has arguments that are not an object"
    if json.loads(json.dumps(function["arguments"])) != function["arguments"]:
        return "has arguments that JSON does not round-trip"
    return None


def _kwargs_unsendable(kwargs: dict[str, Any]) -> bool:
    """A Struct holds numbers as doubles: an int kwarg would reach the template as 2.0."""

    def exact(value: Any) -> bool:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return True
        if isinstance(value, list):
            return all(exact(v) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and exact(v) for k, v in value.items())
        return False  # numbers and anything else

    return not exact(kwargs)


def _sent_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as a client can send them (see `_TOOL_FIELDS_DROPPED`)."""
    if tools is None:
        return None
    sent = copy.deepcopy(tools)
    for tool in sent:
        for key in _TOOL_FIELDS_DROPPED:
            tool["function"].pop(key, None)
    return sent


# ---- dicts to protos ------------------------------------------------------------------


def _message_pb(message: dict[str, Any], as_parts: bool) -> chat_pb2.ChatMessage:
    """`as_parts`: a multi-line content goes as one text part per line, which the
    servicer joins with "\\n" back into the same string."""
    calls = [
        chat_pb2.ToolCall(
            id=call.get("id", ""),
            name=call["function"]["name"],
            arguments=json.dumps(call["function"]["arguments"], ensure_ascii=False),
        )
        for call in message.get("tool_calls", ())
    ]
    pb = chat_pb2.ChatMessage(
        role=message["role"],
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id", ""),
        reasoning=message.get("reasoning_content", ""),
        name=message.get("name", ""),
    )
    content = message["content"]
    if as_parts and "\n" in content:
        pb.content_parts.extend(
            chat_pb2.ContentPart(type="text", text=line) for line in content.split("\n")
        )
    else:
        pb.content = content
    return pb


def _tool_pb(tool: dict[str, Any]) -> chat_pb2.Tool:
    function = tool["function"]
    return chat_pb2.Tool(
        name=function["name"],
        description=function.get("description", ""),
        parameters=(json.dumps(function["parameters"], ensure_ascii=False)
                    if "parameters" in function else ""),
    )


def _request(
    case: Case,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict[str, Any],
    as_parts: bool = False,
) -> chat_pb2.RenderChatRequest:
    request = chat_pb2.RenderChatRequest(
        messages=[_message_pb(m, as_parts) for m in case.messages],
        tools=[_tool_pb(t) for t in _sent_tools(case.tools) or ()],
        continue_final_message=continue_final_message,
    )
    # Left unset where the default (not continue_final_message) is meant, so that the
    # default is exercised too.
    if add_generation_prompt != (not continue_final_message):
        request.add_generation_prompt = add_generation_prompt
    if kwargs:
        struct = struct_pb2.Struct()
        struct.update(kwargs)
        request.chat_template_kwargs.CopyFrom(struct)
    return request


# ---- the plan: requests and what transformers makes of them ---------------------------


@dataclass(frozen=True)
class Render:
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Refusal:
    error: Exception | None
    """Transformers' error; None: a refusal by the servicer's own rules."""
    field: str = ""
    """For a servicer refusal: the BadRequest field it must name."""


@dataclass(frozen=True)
class Check:
    case: str
    where: str
    request: chat_pb2.RenderChatRequest
    expected: Render | Refusal


@dataclass
class Plan:
    checks: list[Check] = field(default_factory=list)
    unsendable: dict[str, str] = field(default_factory=dict)
    """Case name -> why it was left out."""
    kwargs_left_out: int = 0


def _transformers(
    pair: Pair, case: Case, add_generation_prompt: bool, continue_final: bool, kwargs: Any
) -> Render | Refusal:
    arguments = dict(
        tools=_sent_tools(case.tools),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        **kwargs,
    )
    try:
        text = pair.hf.apply_chat_template(
            copy.deepcopy(case.messages), tokenize=False, **arguments
        )
        ids = pair.hf.apply_chat_template(
            copy.deepcopy(case.messages), tokenize=True, return_dict=False, **arguments
        )
    except Exception as exc:  # the RPC must refuse it too
        return Refusal(exc)
    return Render(text, list(ids))


def _plan(name: str, pair: Pair) -> Plan:
    plan = Plan()
    for case_name, case in RPC_CASES.items():
        reason = _why_unsendable(case)
        if reason is not None:
            plan.unsendable[case_name] = reason
            continue
        has_lines = any("\n" in m["content"] for m in case.messages)
        for add_generation_prompt, continue_final, kwargs in variants(name, pair, case):
            if _kwargs_unsendable(kwargs):
                plan.kwargs_left_out += 1
                continue
            where = f"{name}/{case_name} agp={add_generation_prompt} "
            where += f"continue={continue_final} kwargs={kwargs}"
            expected = _transformers(pair, case, add_generation_prompt, continue_final, kwargs)
            request = _request(case, add_generation_prompt, continue_final, kwargs)
            plan.checks.append(Check(case_name, where, request, expected))
            if has_lines:
                request = _request(case, add_generation_prompt, continue_final, kwargs, True)
                plan.checks.append(Check(case_name, f"{where} as content_parts", request, expected))
    # The corpus's one tool with a non-OpenAI name: refused by the servicer's rules.
    unicode_case = CASES["unicode_and_markup"]
    assert unicode_case.tools is not None
    plan.checks.append(
        Check(
            "unicode_and_markup",
            f"{name}/unicode_and_markup (refused tool name)",
            _request(unicode_case, True, False, {}),
            Refusal(None, field="tools[0].name"),
        )
    )
    return plan


# ---- serving ------------------------------------------------------------------------

Outcome = chat_pb2.RenderChatResponse | grpc.aio.AioRpcError


def _render_over_grpc(pair: Pair, requests: list[chat_pb2.RenderChatRequest]) -> list[Outcome]:
    """Each request's RenderChat answer from one in-process FrontendServer."""
    tokenizer = pair.ours
    eos_id = tokenizer.backend.token_to_id(pair.templates.special_tokens["eos_token"])
    model = ModelInfo(
        name="render-chat-rpc",
        path="/nonexistent",
        architectures=("LlamaForCausalLM",),
        vocab_size=tokenizer.vocab_size,
        max_model_len=1 << 20,
        eos_token_ids=(eos_id,),
        bos_token_id=None,
        dtype="float32",
    )
    outcomes: list[Outcome] = []

    async def main() -> None:
        # Nothing listens on the engine address: RenderChat needs no engine.
        config = FrontendConfig(port=0, engines=("127.0.0.1:1",))
        frontend = FrontendServer(config, tokenizer, model, chat_templates=pair.templates)
        port = await frontend.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = chat_grpc.ChatServiceStub(channel)
                for request in requests:
                    try:
                        outcomes.append(await stub.RenderChat(request, timeout=10))
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append(exc)
        finally:
            await frontend.stop(0)

    asyncio.run(main())
    return outcomes


def _field_violations(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    fields = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            fields += [v.field for v in bad_request.field_violations]
    return fields


def _check_refusal(where: str, expected: Refusal, outcome: Outcome) -> None:
    assert isinstance(outcome, grpc.aio.AioRpcError), (
        f"{where}: the RPC rendered {outcome.prompt!r}, but transformers raised {expected.error!r}"
    )
    assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {outcome!r}"
    error = expected.error
    if error is None:
        assert _field_violations(outcome) == [expected.field], where
        return
    refused = "the chat template refused the conversation: "
    if type(error) is jinja2.TemplateError:  # the template's own raise_exception
        assert outcome.details() == refused + str(error), where
    elif isinstance(error, jinja2.TemplateError):
        assert outcome.details() == f"{refused}chat template failed: {error}", where
    assert _field_violations(outcome) == ["messages"], where


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("fixed_clock")  # both sides print the same date (Llama)
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_render_chat_rpc_matches_transformers(
    pairs: dict[str, Pair],
    name: str,
) -> None:
    pair = pairs[name]
    plan = _plan(name, pair)
    outcomes = _render_over_grpc(pair, [check.request for check in plan.checks])
    compared: dict[str, int] = {}
    refused: dict[str, int] = {}
    for check, outcome in zip(plan.checks, outcomes, strict=True):
        case_name = check.case
        if isinstance(check.expected, Refusal):
            _check_refusal(check.where, check.expected, outcome)
            refused[case_name] = refused.get(case_name, 0) + 1
            continue
        assert not isinstance(outcome, grpc.aio.AioRpcError), (
            f"{check.where}: the RPC refused ({outcome.code()}: {outcome.details()}), but "
            "transformers rendered it"
        )
        assert outcome.prompt == check.expected.text, check.where
        assert list(outcome.token_ids) == check.expected.token_ids, check.where
        compared[case_name] = compared.get(case_name, 0) + 1

    # Not vacuous: the corpus runs nearly whole, and most of it renders.
    assert len(plan.unsendable) <= MAX_UNSENDABLE, plan.unsendable
    assert plan.kwargs_left_out == 0
    assert sum(compared.values()) >= MIN_COMPARED, compared
    # Refusals only where the template refuses by design (and the non-OpenAI tool name).
    by_design = {case for template, case in EXPECTED_REFUSALS if template == name}
    assert set(refused) <= by_design | {"unicode_and_markup"}, refused
    for case_name in RPC_CASES:
        if case_name in plan.unsendable:
            continue
        if (name, case_name) in EXPECTED_REFUSALS:
            assert case_name not in compared, f"{name}/{case_name} should be refused"
        else:
            assert compared.get(case_name, 0) > 0, f"{name}/{case_name}: every variant refused"


def test_the_corpus_is_mostly_sendable() -> None:
    """Which conversations the proto cannot carry, so that a change to the corpus that
    quietly drops more of it from the RPC comparison shows up here."""
    unsendable = {name: _why_unsendable(case) for name, case in RPC_CASES.items()}
    assert {name for name, reason in unsendable.items() if reason} == {
        "tool_round_trip",  # content None; tool_round_trip_empty_content is its "" form
        "unicode_and_markup",  # the tool name "übersetze"; its refusal is checked
    }
