"""A chat request off the wire: validated, and turned into what the template reads.

Everything here is checked before a template runs, so that a bad conversation gets
INVALID_ARGUMENT naming the field (`messages[2].tool_calls[0].arguments`) rather
than whatever error a template would make of it. The output is plain data in the
shape transformers hands templates: messages as dicts with string content, tool
calls with their arguments as objects, tools as OpenAI function schemas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from google.protobuf import json_format

from services.frontend.chat.constraints import FunctionSpec
from services.frontend.errors import invalid_argument

ROLES = ("system", "user", "assistant", "tool", "developer")
# What the OpenAI API allows for a function name; the tool-call formats and the
# grammar that enforces them rely on it too.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

ChatRequestLike = chat_pb2.ChatRequest | chat_pb2.ChatStreamRequest


@dataclass(frozen=True)
class ChatLimits:
    max_messages: int
    max_chars: int


@dataclass(frozen=True)
class Conversation:
    """A request's template inputs."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    """OpenAI-style `{"type": "function", "function": {...}}` entries; None: no tools."""
    functions: list[FunctionSpec]
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool


def read_conversation(
    request: ChatRequestLike | chat_pb2.RenderChatRequest, limits: ChatLimits
) -> Conversation:
    """The template inputs of a request; RequestError (INVALID_ARGUMENT) when malformed."""
    count = len(request.messages)
    if not count:
        raise invalid_argument("messages", "messages is empty: give at least one message")
    if count > limits.max_messages:
        raise invalid_argument(
            "messages", f"messages has {count} messages, at most {limits.max_messages} are "
            "allowed (--max-chat-messages)")
    size = _size(request)
    if size > limits.max_chars:
        raise invalid_argument(
            "messages", f"the conversation and its tools have {size} characters, at most "
            f"{limits.max_chars} are allowed (--max-chat-chars)")
    messages = [_message(i, m) for i, m in enumerate(request.messages)]
    functions = _functions(request.tools)
    tools = [_tool_schema(tool, f) for tool, f in zip(request.tools, functions, strict=True)]
    continue_final = request.continue_final_message
    if request.HasField("add_generation_prompt"):
        add_generation_prompt = request.add_generation_prompt
    else:
        add_generation_prompt = not continue_final
    if continue_final and add_generation_prompt:
        raise invalid_argument(
            "continue_final_message", "continue_final_message and add_generation_prompt "
            "cannot both be true: one continues the final message, the other opens a new one")
    if continue_final and messages[-1]["role"] != "assistant":
        raise invalid_argument(
            "continue_final_message", "continue_final_message needs an assistant message "
            f"last, got role {messages[-1]['role']!r}")
    return Conversation(
        messages=messages,
        tools=tools or None,
        functions=functions,
        template_kwargs=_template_kwargs(request),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
    )


def _size(request: ChatRequestLike | chat_pb2.RenderChatRequest) -> int:
    total = 0
    for m in request.messages:
        total += len(m.content) + len(m.reasoning) + len(m.name) + len(m.tool_call_id)
        total += sum(len(p.text) for p in m.content_parts)
        total += sum(len(c.name) + len(c.arguments) + len(c.id) for c in m.tool_calls)
    for tool in request.tools:
        total += len(tool.name) + len(tool.description) + len(tool.parameters)
    return total


def _message(i: int, m: chat_pb2.ChatMessage) -> dict[str, Any]:
    field = f"messages[{i}]"
    if m.role not in ROLES:
        raise invalid_argument(
            f"{field}.role", f"{field}.role is {m.role!r}; expected one of {', '.join(ROLES)}")
    message: dict[str, Any] = {"role": m.role, "content": _content(field, m)}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise invalid_argument(f"{field}.tool_calls",
                                   f"{field}.tool_calls is only allowed on assistant messages")
        message["tool_calls"] = [
            _tool_call(f"{field}.tool_calls[{j}]", call) for j, call in enumerate(m.tool_calls)]
    if m.reasoning:
        if m.role != "assistant":
            raise invalid_argument(f"{field}.reasoning",
                                   f"{field}.reasoning is only allowed on assistant messages")
        message["reasoning_content"] = m.reasoning
    if m.tool_call_id:
        if m.role != "tool":
            raise invalid_argument(f"{field}.tool_call_id",
                                   f"{field}.tool_call_id is only allowed on tool messages")
        message["tool_call_id"] = m.tool_call_id
    return message


def _content(field: str, m: chat_pb2.ChatMessage) -> str:
    if not m.content_parts:
        return m.content
    if m.content:
        raise invalid_argument(f"{field}.content_parts",
                               f"{field} has both content and content_parts; give one")
    for j, part in enumerate(m.content_parts):
        if part.type != "text":
            raise invalid_argument(
                f"{field}.content_parts[{j}].type",
                f"{field}.content_parts[{j}].type is {part.type!r}; only \"text\" is supported")
    # Text templates expect a string; parts join the way OpenAI-compatible servers do.
    return "\n".join(part.text for part in m.content_parts)


def _tool_call(field: str, call: chat_pb2.ToolCall) -> dict[str, Any]:
    if not call.name:
        raise invalid_argument(f"{field}.name", f"{field}.name is empty")
    arguments = _json_object(f"{field}.arguments", call.arguments or "{}")
    entry: dict[str, Any] = {"type": "function",
                             "function": {"name": call.name, "arguments": arguments}}
    if call.id:
        entry["id"] = call.id
    return entry


def _functions(tools: Any) -> list[FunctionSpec]:
    functions: list[FunctionSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"tools[{i}]"
        if not _FUNCTION_NAME.fullmatch(tool.name):
            raise invalid_argument(
                f"{field}.name", f"{field}.name {tool.name!r} must be 1 to 64 characters of "
                "letters, digits, '_', '.' and '-'")
        if tool.name in seen:
            raise invalid_argument(f"{field}.name",
                                   f"{field}.name {tool.name!r} is given twice")
        seen.add(tool.name)
        parameters = (_json_object(f"{field}.parameters", tool.parameters)
                      if tool.parameters else {"type": "object", "properties": {}})
        functions.append(FunctionSpec(tool.name, parameters))
    return functions


def _tool_schema(tool: chat_pb2.Tool, function: FunctionSpec) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": function.name}
    if tool.description:
        spec["description"] = tool.description
    if tool.parameters:
        # A tool without parameters reaches the template without them, as transformers
        # gives it (templates print what they get); the constraint still takes `{}`.
        spec["parameters"] = function.parameters
    return {"type": "function", "function": spec}


def _json_object(field: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid_argument(field, f"{field} is not valid JSON: {exc}") from None
    except RecursionError:
        # json's decoder recurses once per level: a 10,000-deep schema overflows it.
        raise invalid_argument(field, f"{field} is nested too deeply to parse") from None
    if not isinstance(value, dict):
        raise invalid_argument(field, f"{field} must be a JSON object, got "
                                      f"{type(value).__name__}")
    return value


def _template_kwargs(request: ChatRequestLike | chat_pb2.RenderChatRequest) -> dict[str, Any]:
    if not request.HasField("chat_template_kwargs"):
        return {}
    kwargs: dict[str, Any] = _whole_numbers_as_ints(
        json_format.MessageToDict(request.chat_template_kwargs))
    return kwargs


def _whole_numbers_as_ints(value: Any) -> Any:
    """A Struct holds every number as a double, so `{"budget": 1024}` would reach the
    template as 1024.0 and print so; whole numbers go back to ints, as a JSON parser
    gives them to transformers' apply_chat_template."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers_as_ints(v) for v in value]
    return value
