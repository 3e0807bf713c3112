"""OpenAI request bodies, and their translation into corestream's request protos.

The bodies accept what OpenAI's API defines plus the extra fields vLLM reads, so a
client written against vLLM (the `openai` SDK with `extra_body`) works unchanged.
Checking is split in two:

- pydantic checks shapes and types, and the integer ranges the protos cannot hold
  (a uint32 token id, an int32 count), so that a ValidationError, not a protobuf
  ValueError, reports them; the app answers it with HTTP 400 and its `loc`.
- the conversion functions refuse what is well-typed but not served (echo, suffix,
  two output constraints, ...) with `invalid_argument(field, ...)`, where `field` is
  the OpenAI body's own field name.

Value ranges that the server checks anyway (temperature >= 0, n <= 16, ...) are not
checked here: the request path names them as `sampling.<field>`, and the HTTP edge
(http_errors.py) renames that with `completion_names` / `chat_names` to the body's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from pydantic import BaseModel, ConfigDict, Field

from services.frontend.chat.request import ROLES
from services.frontend.errors import RequestError, invalid_argument

# The widths of the proto fields these values land in.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")

# What the request path accepts, stated in the OpenAPI document (openapi.py) only: the
# request path checks these itself, with messages naming the field.
REQUEST_ID = Field(default=None,
                   json_schema_extra={"pattern": "^[!-~]([ -~]{0,254}[!-~])?$"})


class _Model(BaseModel):
    # Clients send many fields this server has no use for (`user`, `metadata`,
    # `store`, ...); refusing them would break clients that work elsewhere.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = None


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` (the successor of its `guided_*` fields)."""

    # `json` would shadow a BaseModel attribute.
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Declared only to refuse it: ignoring a constraint would return unconstrained
    # output as if it were constrained.
    structural_tag: Any = None


class _SamplingBody(_Model):
    """The fields that completions and chat share; most end up in SamplingParams."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    request_id: str | None = REQUEST_ID
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(_SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # OpenAI's default; null asks for as many tokens as fit in the context.
    max_tokens: Int32 | None = 16
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None
    # vLLM's extras.
    skip_special_tokens: bool | None = None
    prompt_logprobs: TopLogprobs | None = None
    # Each choice also carries the ids of its generated tokens (not the prompt's).
    return_token_ids: bool = False


class ContentPart(_Model):
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None


class FunctionCall(_Model):
    name: str
    # Passed on as written; the server checks that it is a JSON object.
    arguments: str = ""


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # vLLM reads `reasoning_content`; newer clients send `reasoning`.
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionBody(_SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # vLLM's extras. skip_special_tokens is accepted for compatibility and has no
    # effect: a chat answer keeps special tokens while its parsers read it.
    skip_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False


# How the request path's field names read in each door's body, where they differ
# beyond `sampling.<name>` -> `<name>` (http_errors.openai_field).
COMPLETION_NAMES: Mapping[str, str] = {"text": "prompt"}
CHAT_NAMES: Mapping[str, str] = {
    "prompt": "messages",  # the prompt is the rendered conversation
    "sampling.logprobs": "top_logprobs",
}


def completion_names(body: CompletionBody) -> dict[str, str]:
    """COMPLETION_NAMES and the body's own: the field its constraint came from."""
    names = dict(COMPLETION_NAMES)
    try:
        found = _constraints(body)
    except RequestError:
        found = []  # refused, naming the body's field
    for field, kind, _ in found:
        names[f"sampling.{kind}"] = field
    return names


def chat_names(body: ChatCompletionBody) -> dict[str, str]:
    """CHAT_NAMES and the body's own: which of the two max_tokens it gave."""
    names = dict(CHAT_NAMES)
    if body.max_completion_tokens is not None:
        names["sampling.max_tokens"] = "max_completion_tokens"
    return names


def completion_requests(body: CompletionBody) -> list[generate_pb2.GenerateStreamRequest]:
    """One request per prompt, in prompt order, each with an empty request_id.

    Choice `i` of prompt `p` is the response's choice `p * n + i` (n = body.n or 1).
    """
    if body.echo:
        raise invalid_argument("echo", "echo is not supported: the response holds only "
                                       "the generated text, not the prompt")
    if body.suffix:
        raise invalid_argument("suffix", "suffix is not supported (no fill-in-the-middle)")
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise invalid_argument("best_of", f"best_of must equal n ({n}) if given, got "
                                          f"{body.best_of}: candidates are not ranked on "
                                          "the server; ask for n samples instead")
    if body.prompt_logprobs is not None and body.stream:
        raise invalid_argument("prompt_logprobs",
                               "prompt_logprobs is not available with stream: true")
    sampling = _sampling(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
    if body.prompt_logprobs is not None:
        sampling.prompt_logprobs = body.prompt_logprobs
    _set_constraint(sampling, body)
    requests = []
    for prompt in _prompts(body.prompt):
        request = generate_pb2.GenerateStreamRequest(
            sampling=sampling, priority=body.priority, cache_salt=body.cache_salt or "")
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        if body.skip_special_tokens is not None:
            request.skip_special_tokens = body.skip_special_tokens
        requests.append(request)
    return requests


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompt's forms as a list of prompts, none empty (the server would name its own
    field, `text` or `token_ids.ids`, for an empty one)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
        fields = ["prompt"]
    elif prompt and all(isinstance(item, int) for item in prompt):
        prompts = [prompt]  # type: ignore[list-item]
        fields = ["prompt"]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
        fields = [f"prompt[{i}]" for i in range(len(prompts))]
    if not prompts:
        raise invalid_argument("prompt", "prompt is empty: give a string, a list of "
                                         "strings, or token ids")
    for field, item in zip(fields, prompts, strict=True):
        if not item:
            raise invalid_argument(field, f"{field} is empty")
    return prompts


def chat_request(body: ChatCompletionBody) -> chat_pb2.ChatStreamRequest:
    """The chat request, with an empty request_id."""
    if body.top_logprobs and not body.logprobs:
        raise invalid_argument("top_logprobs", "top_logprobs requires logprobs: true")
    max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                  else body.max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = chat_pb2.ChatStreamRequest(
        messages=[_message(i, m) for i, m in enumerate(body.messages)],
        tools=[_tool(tool) for tool in body.tools or ()],
        sampling=_sampling(body, max_tokens=max_tokens, logprobs=logprobs),
        continue_final_message=body.continue_final_message,
        priority=body.priority,
        cache_salt=body.cache_salt or "",
        chat_template=body.chat_template or "",
    )
    if body.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    if body.add_generation_prompt is not None:
        request.add_generation_prompt = body.add_generation_prompt
    if body.chat_template_kwargs is not None:
        # A Struct holds numbers as doubles: the template sees 2 as 2.0.
        request.chat_template_kwargs.update(body.chat_template_kwargs)
    response_format = _chat_response_format(body)
    if response_format is not None:
        request.response_format.CopyFrom(response_format)
    return request


def _message(i: int, m: ChatMessage) -> chat_pb2.ChatMessage:
    field = f"messages[{i}]"
    message = chat_pb2.ChatMessage(role=m.role, name=m.name or "",
                                   tool_call_id=m.tool_call_id or "")
    if isinstance(m.content, str):
        message.content = m.content
    elif m.content is not None:
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise invalid_argument(
                    f"{field}.content[{j}].type", f"{field}.content[{j}].type is "
                    f"{part.type!r}; only \"text\" parts are supported")
            if part.text is None:
                raise invalid_argument(f"{field}.content[{j}].text",
                                       f"{field}.content[{j}].text is missing")
            message.content_parts.add(type="text", text=part.text)
    for call in m.tool_calls or ():
        message.tool_calls.add(id=call.id or "", name=call.function.name,
                               arguments=call.function.arguments)
    reasoning = _reasoning(field, m)
    if reasoning is not None:
        message.reasoning = reasoning
    return message


def _reasoning(field: str, m: ChatMessage) -> str | None:
    if (m.reasoning_content is not None and m.reasoning is not None
            and m.reasoning_content != m.reasoning):
        raise invalid_argument(f"{field}.reasoning", f"{field} has both reasoning_content "
                                                     "and reasoning, and they differ; give one")
    return m.reasoning_content if m.reasoning_content is not None else m.reasoning


def _tool(tool: Tool) -> chat_pb2.Tool:
    function = tool.function
    return chat_pb2.Tool(
        name=function.name,
        description=function.description or "",
        parameters=json.dumps(function.parameters) if function.parameters is not None else "",
    )


_TOOL_CHOICE_MODES = {
    "auto": chat_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": chat_pb2.TOOL_CHOICE_MODE_NONE,
    "required": chat_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def _tool_choice(choice: str | NamedToolChoice) -> chat_pb2.ToolChoice:
    if isinstance(choice, NamedToolChoice):
        return chat_pb2.ToolChoice(function=choice.function.name)
    return chat_pb2.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])


def _sampling(
    body: _SamplingBody, *, max_tokens: int | None, logprobs: int | None
) -> common_pb2.SamplingParams:
    """The fields both APIs share. A field the client left out stays unset, so that
    the server's default applies (every scalar of SamplingParams is `optional`)."""
    sampling = common_pb2.SamplingParams(
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=_logit_bias(body.logit_bias or {}),
    )
    optional = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "n": body.n,
        "logprobs": logprobs,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(sampling, name, value)
    return sampling


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI keys the bias by token id written as a string (JSON keys are strings)."""
    by_id: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= 2**32:
            raise invalid_argument("logit_bias", f"logit_bias key {key!r} is not a token id "
                                                 "(a non-negative integer as a string)")
        by_id[int(key)] = value
    return by_id


# A constraint as (OpenAI field, SamplingParams constraint field, value).
_Constraint = tuple[str, str, str | list[str] | bool]


def _constraints(body: _SamplingBody) -> list[_Constraint]:
    """Every output constraint the body asks for, wherever it was written."""
    found: list[_Constraint] = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(_response_format_constraint(body.response_format))
    if body.guided_json is not None:
        found.append(("guided_json", "json_schema", _schema_text(body.guided_json)))
    if body.guided_regex is not None:
        found.append(("guided_regex", "regex", body.guided_regex))
    if body.guided_choice is not None:
        found.append(("guided_choice", "choice", body.guided_choice))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", "grammar", body.guided_grammar))
    outputs = body.structured_outputs
    if outputs is not None:
        if outputs.structural_tag is not None:
            raise invalid_argument("structured_outputs.structural_tag",
                                   "structured_outputs.structural_tag is not supported")
        if outputs.json_ is not None:
            found.append(("structured_outputs.json", "json_schema", _schema_text(outputs.json_)))
        if outputs.regex is not None:
            found.append(("structured_outputs.regex", "regex", outputs.regex))
        if outputs.choice is not None:
            found.append(("structured_outputs.choice", "choice", outputs.choice))
        if outputs.grammar is not None:
            found.append(("structured_outputs.grammar", "grammar", outputs.grammar))
        if outputs.json_object:
            found.append(("structured_outputs.json_object", "json_object", True))
    if len(found) > 1:
        names = ", ".join(field for field, _, _ in found)
        raise invalid_argument(found[1][0], f"at most one output constraint may be given, "
                                            f"got {names}")
    return found


def _response_format_constraint(response_format: ResponseFormat) -> _Constraint:
    if response_format.type == "json_object":
        return ("response_format", "json_object", True)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        field = "response_format.json_schema" + (".schema" if spec is not None else "")
        raise invalid_argument(field, f"{field} is required with response_format type "
                                      "json_schema")
    return ("response_format", "json_schema", json.dumps(spec.schema_))


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _set_constraint(sampling: common_pb2.SamplingParams, body: CompletionBody) -> None:
    for _, kind, value in _constraints(body):
        if kind == "choice":
            sampling.choice.choices.extend(value)  # type: ignore[arg-type]
        else:
            setattr(sampling, kind, value)


def _chat_response_format(body: ChatCompletionBody) -> chat_pb2.ResponseFormat | None:
    """A chat answer is constrained only through response_format (the servicer refuses a
    sampling constraint), so JSON constraints from vLLM's fields become one; the others
    have no response_format equivalent."""
    constraints = _constraints(body)
    if not constraints:
        if body.response_format is not None:  # type "text"
            return chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_TEXT)
        return None
    field, kind, value = constraints[0]
    if kind == "json_schema":
        return chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
                                       json_schema=str(value))
    if kind == "json_object":
        return chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT)
    raise invalid_argument(field, f"{field} is not supported in a chat request: use "
                                  "response_format (json_schema or json_object) or "
                                  "tool_choice, or /v1/completions for this constraint")
