"""Chat answering: conversations in, answers out, on the frontend's request path
(pipeline.py), for every door that takes chat (ChatService, /v1/chat/completions).

A chat request is rendered with the checkpoint's own template, tokenized without
adding special tokens again (the template wrote them), and then runs exactly like
a Generate request: the same validation, limits, routing, telemetry and abort.
`ChatAnswering.answer` walks the pipeline in sequence, with no callback into this
module: `Pipeline.request` opens the telemetry and time limit, the pipeline's checks
admit and validate, the conversation is rendered and its constraint built here,
`Pipeline.prepared` applies the limits and `Pipeline.run` runs it.

What comes back is read per sample by an `AnswerParser` (reasoning, content, tool
calls). When a parser reads the answer, special tokens are kept in the detokenized
text, since markers like `[TOOL_CALLS]` are special tokens in some vocabularies;
only the stop token that ended the answer is cut off.

`tool_choice` required or a named function and `response_format` become an output
constraint (see constraints.py), so the answer has the promised form even
from a model that would not write it by itself. A named function is called exactly
once; `required` makes one call or, unless `parallel_tool_calls` is false, a list
that the model may end after any call. An answer that max_tokens cuts inside a call
keeps the calls before it, drops the cut one (it is not content) and finishes with
"length".
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2

from services.common.constraints import OutputConstraint
from services.frontend.chat.constraints import (
    FunctionSpec,
    added_token_ids,
    response_format_constraint,
    tool_call_constraint,
    with_reasoning_prefix,
)
from services.frontend.chat.parsers.answer import AnswerDelta, AnswerParser
from services.frontend.chat.parsers.reasoning import (
    REASONING_PARSERS,
    make_reasoning_parser,
    prompt_opens_reasoning,
)
from services.frontend.chat.parsers.tools import make_tool_parser, pick_tool_parser
from services.frontend.chat.request import ChatLimits, ChatRequestLike, read_conversation
from services.frontend.chat.template import (
    ChatTemplates,
    RenderLimits,
    TemplateError,
    compile_template,
    load_chat_templates,
    render_chat,
)
from services.frontend.config import FrontendConfig
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.generate.runner import PreparedRequest
from services.frontend.generate.telemetry import RequestTelemetry
from services.frontend.pipeline import Pipeline
from services.frontend.tokenizer import TextTokenizer

_NO_TEMPLATE = (
    "the served model has no chat template, so it cannot take chat messages; start the "
    "frontend with --chat-template FILE (a Jinja chat template), or use GenerateService "
    "with a prompt you render yourself"
)


@dataclass(frozen=True)
class Rendered:
    prompt: str
    token_ids: list[int]
    template: str
    functions: list[FunctionSpec]


@dataclass
class _Answers:
    """One call's per-sample parsers."""

    make_parser: functools.partial[AnswerParser]
    keeps_special_tokens: bool
    stop_token_ids: frozenset[int]
    """EOS and the request's stop tokens: the ids that end an answer."""
    parsers: dict[int, AnswerParser] = field(default_factory=dict)

    def parser(self, index: int) -> AnswerParser:
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.make_parser()
        return parser


class ChatAnswering:
    def __init__(self, config: FrontendConfig, pipeline: Pipeline,
                 tokenizer: TextTokenizer, templates: ChatTemplates,
                 eos_token_ids: tuple[int, ...]) -> None:
        self._config = config
        self._pipeline = pipeline
        self._tokenizer = tokenizer
        self._templates = templates
        self._limits = ChatLimits(config.max_chat_messages, config.max_chat_chars)
        # The rendered prompt may well be longer than the conversation (tools' schemas
        # written out, role markers), but not by orders of magnitude.
        self._render_limits = RenderLimits(seconds=config.chat_template_render_timeout_s,
                                           max_chars=8 * config.max_chat_chars)
        self._special_tokens = added_token_ids(tokenizer.backend)
        self._eos_token_ids = eos_token_ids

    async def answer(self, request_id: str, request: ChatRequestLike,
                     metadata: Mapping[str, str]) -> AsyncIterator[chat_pb2.ChatStreamResponse]:
        """A chat request's answer as stream deltas; RequestError when it fails (any
        transport: the gRPC RPCs and the HTTP API both read this)."""
        async with self._pipeline.request(request_id, metadata, "chat") as telemetry:
            prepared, answers = await self._prepare(request_id, request, telemetry)
            async for chunk in self._pipeline.run(prepared, telemetry):
                response = self._stream_response(answers, chunk)
                if response is not None:
                    yield response

    def _stream_response(
        self, answers: _Answers, chunk: generate_pb2.GenerateStreamResponse
    ) -> chat_pb2.ChatStreamResponse | None:
        delta, finish_reason = self._read(answers, chunk)
        if not (delta or finish_reason or chunk.logprobs or chunk.HasField("usage")
                or chunk.warnings):
            return None
        response = chat_pb2.ChatStreamResponse(
            request_id=chunk.request_id, index=chunk.index, content=delta.content,
            reasoning=delta.reasoning, finish_reason=finish_reason, logprobs=chunk.logprobs,
            warnings=chunk.warnings, weight_version=chunk.weight_version,
            tool_calls=[chat_pb2.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "",
                                               arguments=d.arguments)
                        for d in delta.tool_calls],
        )
        if chunk.HasField("usage"):
            response.usage.CopyFrom(chunk.usage)
        return response

    def _read(self, answers: _Answers,
              chunk: generate_pb2.GenerateStreamResponse) -> tuple[AnswerDelta, int]:
        """A chunk's answer delta and, on the sample's last chunk, its finish reason."""
        parser = answers.parser(chunk.index)
        text = chunk.text
        if (answers.keeps_special_tokens and chunk.finish_reason
                and chunk.token_ids and chunk.token_ids[-1] in answers.stop_token_ids):
            # The token that ended the answer (EOS or a stop token; a constraint may
            # also end on EOS) is not part of it.
            stop_text = self._tokenizer.decode([chunk.token_ids[-1]], skip_special_tokens=False)
            text = text.removesuffix(stop_text)
        delta = parser.feed(text) if text else AnswerDelta()
        if not chunk.finish_reason:
            return delta, chat_pb2.CHAT_FINISH_REASON_UNSPECIFIED
        cut = chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return delta + parser.finish(cut), parser.finish_reason(chunk.finish_reason)

    async def _prepare(self, request_id: str, request: ChatRequestLike,
                       telemetry: RequestTelemetry) -> tuple[PreparedRequest, _Answers]:
        """The request validated, rendered and constrained, ready to run; and the
        parsers that read its answer."""
        pipeline = self._pipeline
        with telemetry.phase("validate"):
            pipeline.check_accepting()
            # Before rendering: a pooling model may well have no chat template.
            pipeline.check_generates()
            sampling = pipeline.check_sampling(request.sampling)
            if sampling.constraint is not None:
                field_name = sampling.constraint.field
                raise invalid_argument(
                    field_name, f"{field_name} is not accepted in a chat request: use "
                    "response_format, or tool_choice to require a tool call")
        with telemetry.phase("render"):
            rendered = await self.render(request)
        tool_parser = self._tool_parser(request, rendered)
        constraint = self._constraint(request, rendered, tool_parser)
        reasoning_parser = self._config.reasoning_parser or None
        starts_in_reasoning = prompt_opens_reasoning(rendered.prompt)
        if constraint is not None:
            field_name = _constraint_field(request)
            with telemetry.phase("validate"):
                accepted = await pipeline.check_constraint(constraint, field_name)
            if reasoning_parser is not None and accepted.output_check is not None:
                # The answer's grammar then follows a reasoning block, and the output
                # check has no way to tell the JSON from the reasoning.
                raise invalid_argument(field_name, (
                    f"{field_name} is not a constraint this server can follow after "
                    "reasoning: " + "; ".join(accepted.checked.notes)))
            if reasoning_parser is not None:
                try:
                    constraint = with_reasoning_prefix(
                        constraint, opened=starts_in_reasoning,
                        required=REASONING_PARSERS[reasoning_parser].always_reasons,
                        special_tokens=self._special_tokens)
                except ValueError as exc:
                    raise invalid_argument(field_name, f"{field_name}: {exc}") from None
        answers = _Answers(
            make_parser=functools.partial(
                _answer_parser, reasoning_parser, starts_in_reasoning, tool_parser,
                _max_calls(request)),
            keeps_special_tokens=bool(tool_parser or reasoning_parser),
            stop_token_ids=frozenset((*self._eos_token_ids, *sampling.stop_token_ids)))
        prepared = PreparedRequest(
            request_id=request_id,
            prompt_token_ids=rendered.token_ids,
            sampling=dataclasses.replace(sampling, constraint=constraint),
            skip_special_tokens=not answers.keeps_special_tokens,
            priority=request.priority,
            cache_salt=request.cache_salt,
            data_parallel_rank=(request.data_parallel_rank
                                if request.HasField("data_parallel_rank") else None),
        )
        return await pipeline.prepared(prepared, rendered.prompt, telemetry), answers

    async def render(self, request: ChatRequestLike | chat_pb2.RenderChatRequest) -> Rendered:
        """The conversation rendered with its template and tokenized (RenderChat's
        answer, and the prompt of a chat request)."""
        conversation = read_conversation(request, self._limits)
        template = await self._template(request, has_tools=conversation.tools is not None)
        try:
            # Off the event loop: a long conversation or tool list takes a while, and a
            # request's own template may take up to its render limit.
            prompt = await asyncio.to_thread(
                render_chat, template, conversation.messages, tools=conversation.tools,
                add_generation_prompt=conversation.add_generation_prompt,
                continue_final_message=conversation.continue_final_message,
                template_kwargs=conversation.template_kwargs,
                special_tokens=self._templates.special_tokens, limits=self._render_limits)
        except TemplateError as exc:
            raise invalid_argument("messages", f"the chat template refused the "
                                               f"conversation: {exc}") from None
        token_ids = await self._pipeline.encode(prompt, add_special_tokens=False)
        return Rendered(prompt, token_ids, template, conversation.functions)

    async def _template(self, request: ChatRequestLike | chat_pb2.RenderChatRequest,
                        has_tools: bool) -> str:
        if request.chat_template:
            if not self._config.trust_request_chat_template:
                raise invalid_argument(
                    "chat_template", "this server does not accept chat templates in requests "
                    "(the frontend runs them only with --trust-request-chat-template)")
            if len(request.chat_template) > self._config.max_chat_chars:
                raise invalid_argument(
                    "chat_template", f"chat_template has {len(request.chat_template)} "
                    f"characters, at most {self._config.max_chat_chars} are allowed")
            try:
                # Off the event loop: jinja and Python compile a template of
                # max_chat_chars characters in about a second.
                await asyncio.to_thread(compile_template, request.chat_template)
            except TemplateError as exc:
                raise invalid_argument("chat_template", str(exc)) from None
            return request.chat_template
        template = self._templates.select(has_tools)
        if template is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, _NO_TEMPLATE,
                               reason="NO_CHAT_TEMPLATE")
        return template

    def _tool_parser(self, request: ChatRequestLike, rendered: Rendered) -> str | None:
        """The format to read tool calls in, or None when the answer is content only."""
        mode = request.tool_choice.WhichOneof("choice")
        if not rendered.functions or (
                mode == "mode" and request.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_NONE):
            return None
        configured = self._config.tool_call_parser
        if configured == "none":
            return None
        if configured == "auto":
            return _picked_parser(rendered.template)
        return configured

    def _constraint(self, request: ChatRequestLike, rendered: Rendered,
                    tool_parser: str | None) -> OutputConstraint | None:
        """The output constraint that tool_choice or response_format asks for."""
        choice = request.tool_choice
        if not _requires_call(choice):
            return _response_format(request.response_format)
        functions = rendered.functions
        if choice.WhichOneof("choice") == "function":
            functions = [f for f in functions if f.name == choice.function]
            if not functions:
                raise invalid_argument(
                    "tool_choice.function", f"tool_choice.function {choice.function!r} is not "
                    "one of the request's tools")
        if not rendered.functions:
            raise invalid_argument("tool_choice", "tool_choice requires a tool call, but the "
                                                  "request gives no tools")
        format_type = request.response_format.type
        if format_type not in (chat_pb2.RESPONSE_FORMAT_TYPE_UNSPECIFIED,
                               chat_pb2.RESPONSE_FORMAT_TYPE_TEXT):
            raise invalid_argument(
                "response_format", "response_format cannot be combined with a tool_choice "
                "that requires a tool call: the answer is the call")
        if tool_parser is None:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "tool_choice requires a tool call, but no tool-call format is known for this "
                "model's chat template; start the frontend with --tool-call-parser "
                "(hermes, llama3_json or mistral)", reason="NO_TOOL_CALL_FORMAT")
        try:
            # A named function is called exactly once, as OpenAI's forced function is;
            # `required` makes one or more calls unless parallel calls are turned off.
            return tool_call_constraint(tool_parser, functions,
                                        parallel=_max_calls(request) is None,
                                        special_tokens=self._special_tokens)
        except ValueError as exc:
            raise invalid_argument("tools", f"tools: {exc}") from None


def _response_format(response_format: chat_pb2.ResponseFormat) -> OutputConstraint | None:
    kind = response_format.type
    if kind == chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA:
        if not response_format.json_schema:
            raise invalid_argument("response_format.json_schema",
                                   "response_format.json_schema is empty")
        return response_format_constraint("json_schema", response_format.json_schema)
    if kind == chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT:
        return response_format_constraint("json_object", "")
    return None


def _constraint_field(request: ChatRequestLike) -> str:
    """Where a request's constraint came from, for error messages."""
    return "tools" if _requires_call(request.tool_choice) else "response_format.json_schema"


def _requires_call(choice: chat_pb2.ToolChoice) -> bool:
    mode = choice.WhichOneof("choice")
    return mode == "function" or (
        mode == "mode" and choice.mode == chat_pb2.TOOL_CHOICE_MODE_REQUIRED)


@functools.lru_cache(maxsize=16)
def _picked_parser(template: str) -> str | None:
    return pick_tool_parser(template)


def _max_calls(request: ChatRequestLike) -> int | None:
    """At most one call under `parallel_tool_calls: false` or a named function (the
    grammar already makes one there; the parser holds a model in `auto` to it too)."""
    if request.tool_choice.WhichOneof("choice") == "function":
        return 1
    if request.HasField("parallel_tool_calls") and not request.parallel_tool_calls:
        return 1
    return None


def _answer_parser(reasoning: str | None, starts_in_reasoning: bool,
                   tools: str | None, max_calls: int | None) -> AnswerParser:
    return AnswerParser(
        make_reasoning_parser(reasoning, starts_in_reasoning) if reasoning else None,
        make_tool_parser(tools) if tools else None,
        max_calls,
    )


def load_templates(config: FrontendConfig, model_dir: Path) -> ChatTemplates:
    """The served templates; a broken one fails the start, not the first request."""
    templates = load_chat_templates(model_dir, Path(config.chat_template)
                                    if config.chat_template else None)
    for template in (templates.default, *templates.named.values()):
        if template is not None:
            compile_template(template)
    return templates
