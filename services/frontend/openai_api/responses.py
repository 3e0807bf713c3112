"""OpenAI response bodies built from corestream's response protos.

Every function returns plain dicts and lists, ready for `json.dumps`. The shapes are
OpenAI's, plus what vLLM adds and its clients read (`stop_reason`, `reasoning_content`,
finish reason "abort", `max_model_len` on a model), and ours: a top-level `warnings`
list (only when not empty) naming what of a JSON Schema the grammar does not enforce,
and finish reason "schema_mismatch".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2

FINISH_REASONS: Mapping[int, str] = {
    common_pb2.FINISH_REASON_EOS_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    # A pause in mode abort: distinct on gRPC, but vLLM's "abort" here, which the RL
    # trainers written against vLLM already resubmit on.
    common_pb2.FINISH_REASON_PAUSED: "abort",
    # The grammar completed but the output fails the schema it only approximated
    # (the response's warnings say what); ours, OpenAI has no such case.
    common_pb2.FINISH_REASON_SCHEMA_MISMATCH: "schema_mismatch",
    # Normally the failed call's status reaches the client instead; vLLM's value.
    common_pb2.FINISH_REASON_ERROR: "error",
}
"""Ours -> OpenAI's; FINISH_REASON_UNSPECIFIED (not finished) is absent, i.e. null."""

CHAT_FINISH_REASONS: Mapping[int, str] = {
    chat_pb2.CHAT_FINISH_REASON_STOP: "stop",
    chat_pb2.CHAT_FINISH_REASON_LENGTH: "length",
    chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS: "tool_calls",
    chat_pb2.CHAT_FINISH_REASON_ABORT: "abort",
    chat_pb2.CHAT_FINISH_REASON_PAUSED: "abort",  # as FINISH_REASON_PAUSED above
    chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH: "schema_mismatch",
}

# JSON has no -inf; vLLM writes a token the model rules out with this logprob.
_LOGPROB_FLOOR = -9999.0

Json = dict[str, Any]
Positions = Sequence[common_pb2.PositionLogprobs]
_StopCarrier = generate_pb2.Completion | generate_pb2.GenerateStreamResponse


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def usage_json(usage: common_pb2.Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sum_usage(usages: Iterable[common_pb2.Usage]) -> common_pb2.Usage:
    """One Usage for a completions request with several prompts (one request each)."""
    total = common_pb2.Usage()
    for usage in usages:
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.cached_tokens += usage.cached_tokens
    return total


class _Versioned(Protocol):
    @property
    def weight_version(self) -> str: ...


def _stop_reason(message: _StopCarrier) -> str | int | None:
    """What vLLM calls stop_reason: the stop string or stop token id that ended the
    sample; None for any other ending, the model's own EOS included."""
    if message.finish_reason == common_pb2.FINISH_REASON_STOP_STRING:
        return message.stop_string if message.HasField("stop_string") else None
    if message.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN:
        return message.stop_token_id if message.HasField("stop_token_id") else None
    return None


def completion_logprobs(positions: Positions, text_offset: int = 0) -> Json:
    """The legacy completions logprobs object.

    `top_logprobs` maps token text to logprob, the sampled token included as OpenAI
    does (tokens with equal text collapse into one key). `text_offset` counts
    characters from the start of the choice's text, token by token from `text_offset`,
    as vLLM counts them: by the length of each token's text.
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = text_offset
    for position in positions:
        tokens.append(position.token)
        token_logprobs.append(_logprob(position.logprob))
        top = {t.token: _logprob(t.logprob) for t in position.top}
        top.setdefault(position.token, _logprob(position.logprob))
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(position.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs_json(positions: Positions) -> list[dict[str, Json] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing precedes it),
    then per position {token id: {logprob, rank, decoded_token}} for the prompt's token
    and the most likely alternatives."""
    out: list[dict[str, Json] | None] = [None]
    for position in positions:
        entry: dict[str, Json] = {
            str(top.token_id): {"logprob": _logprob(top.logprob), "rank": rank,
                                "decoded_token": top.token}
            for rank, top in enumerate(position.top, start=1)
        }
        entry[str(position.token_id)] = {"logprob": _logprob(position.logprob),
                                         "rank": position.rank,
                                         "decoded_token": position.token}
        out.append(entry)
    return out


class CompletionLogprobs:
    """The logprobs of one streamed completions response, chunk by chunk.

    Kept per stream because `text_offset` counts from the start of each choice's
    text, so a chunk's offsets continue where that choice's previous chunk ended.
    """

    def __init__(self) -> None:
        self._offsets: dict[int, int] = {}

    def chunk(self, index: int, chunk: generate_pb2.GenerateStreamResponse) -> Json:
        """The logprobs object of choice `index`'s next chunk; call it for each of the
        choice's chunks that carries text, in order."""
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(chunk.text)
        return completion_logprobs(chunk.logprobs, offset)


def completion_chunk(
    chunk: generate_pb2.GenerateStreamResponse, *, id: str, model: str, created: int,
    index: int, logprobs: CompletionLogprobs | None, token_ids: bool = False,
) -> Json:
    """One streamed `text_completion` with the chunk as its only choice.

    `index` is the choice's index in the response (prompt_index * n + chunk.index).
    `logprobs` is the stream's CompletionLogprobs when the request asked for logprobs,
    else None. `token_ids` (vLLM's return_token_ids) adds the chunk's token ids.
    """
    choice: Json = {
        "index": index,
        "text": chunk.text,
        "logprobs": logprobs.chunk(index, chunk) if logprobs is not None else None,
        "finish_reason": FINISH_REASONS.get(chunk.finish_reason),
        "stop_reason": _stop_reason(chunk),
    }
    if token_ids:
        choice["token_ids"] = list(chunk.token_ids)
    return _with_warnings(_with_version({"id": id, "object": "text_completion",
                                         "created": created, "model": model,
                                         "choices": [choice]}, [chunk]), chunk.warnings)


def completion_response(
    completions: Sequence[tuple[int, generate_pb2.Completion]], usage: common_pb2.Usage, *,
    id: str, model: str, created: int, logprobs: bool,
    prompt_logprobs: Mapping[int, Positions] | None = None, token_ids: bool = False,
    warnings: Sequence[str] = (),
) -> Json:
    """The whole `text_completion`: `completions` pairs each sample with its index in
    the response; `prompt_logprobs` (when the request asked for them) maps a choice's
    index to its prompt's positions; `token_ids` adds each sample's token ids."""
    choices = []
    for index, completion in sorted(completions, key=lambda pair: pair[0]):
        choice: Json = {
            "index": index,
            "text": completion.text,
            "logprobs": completion_logprobs(completion.logprobs) if logprobs else None,
            "finish_reason": FINISH_REASONS.get(completion.finish_reason),
            "stop_reason": _stop_reason(completion),
        }
        if token_ids:
            choice["token_ids"] = list(completion.token_ids)
        if prompt_logprobs is not None:
            positions = prompt_logprobs.get(index)
            choice["prompt_logprobs"] = (prompt_logprobs_json(positions)
                                         if positions is not None else None)
        choices.append(choice)
    return _with_warnings(_with_version(
        {"id": id, "object": "text_completion", "created": created, "model": model,
         "choices": choices, "usage": usage_json(usage)}, [c for _, c in completions]),
        warnings)


def chat_logprobs(positions: Positions) -> Json:
    return {"content": [
        {"token": p.token, "logprob": _logprob(p.logprob), "bytes": list(p.token_bytes),
         "top_logprobs": [{"token": t.token, "logprob": _logprob(t.logprob),
                           "bytes": list(t.token_bytes)} for t in p.top]}
        for p in positions
    ]}


def _tool_call_delta(call: chat_pb2.ToolCallDelta) -> Json:
    # OpenAI sends id, type and name once, on a call's first delta (the one with an id).
    if call.id:
        return {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, "function": {"arguments": call.arguments}}


def chat_chunk(
    chunk: chat_pb2.ChatStreamResponse, *, id: str, model: str, created: int, first: bool,
) -> Json:
    """One `chat.completion.chunk` with the chunk as its only choice; `first` marks the
    sample's first chunk, which carries the role."""
    delta: Json = {}
    if first:
        delta["role"] = "assistant"
    # OpenAI opens a text answer with content "", a tool call with none.
    if chunk.content or (first and not chunk.tool_calls):
        delta["content"] = chunk.content
    if chunk.reasoning:
        delta["reasoning_content"] = chunk.reasoning
        delta["reasoning"] = chunk.reasoning
    if chunk.tool_calls:
        delta["tool_calls"] = [_tool_call_delta(call) for call in chunk.tool_calls]
    choice = {
        "index": chunk.index,
        "delta": delta,
        "logprobs": chat_logprobs(chunk.logprobs) if chunk.logprobs else None,
        "finish_reason": CHAT_FINISH_REASONS.get(chunk.finish_reason),
    }
    return _with_warnings(_with_version({"id": id, "object": "chat.completion.chunk",
                                         "created": created, "model": model,
                                         "choices": [choice]}, [chunk]), chunk.warnings)


def usage_chunk(usage: common_pb2.Usage, *, id: str, model: str, created: int,
                object: str) -> Json:
    """A stream's last chunk under stream_options.include_usage: no choices, the usage.
    `object` is "text_completion" or "chat.completion.chunk"."""
    return {"id": id, "object": object, "created": created, "model": model, "choices": [],
            "usage": usage_json(usage)}


def _chat_message(choice: chat_pb2.ChatChoice) -> Json:
    message: Json = {
        "role": "assistant",
        # OpenAI: null content when the answer is only tool calls.
        "content": None if not choice.content and choice.tool_calls else choice.content,
        "refusal": None,
        "reasoning_content": choice.reasoning or None,
        "reasoning": choice.reasoning or None,
    }
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in choice.tool_calls
        ]
    return message


def chat_response(
    response: chat_pb2.ChatResponse, *, id: str, model: str, created: int, logprobs: bool,
) -> Json:
    """The whole `chat.completion`."""
    choices = [
        {
            "index": choice.index,
            "message": _chat_message(choice),
            "logprobs": chat_logprobs(choice.logprobs) if logprobs else None,
            "finish_reason": CHAT_FINISH_REASONS.get(choice.finish_reason),
            # vLLM's field; the chat protos do not say which stop ended an answer.
            "stop_reason": None,
        }
        for choice in sorted(response.choices, key=lambda c: c.index)
    ]
    return _with_warnings(_with_version(
        {"id": id, "object": "chat.completion", "created": created, "model": model,
         "choices": choices, "usage": usage_json(response.usage)}, response.choices),
        response.warnings)


def _with_version(body: Json, parts: Sequence[_Versioned]) -> Json:
    """`metadata.weight_version` (SGLang's place for it): the version of the weights that
    produced the body's tokens; with `first_weight_version` too where a sample began on
    other weights (a live update while it ran)."""
    last = next((p.weight_version for p in reversed(parts) if p.weight_version), "")
    if not last:
        return body
    metadata: Json = {"weight_version": last}
    firsts = [p.first_weight_version for p in parts
              if getattr(p, "first_weight_version", "")]
    if firsts and firsts[0] != last:
        metadata["first_weight_version"] = firsts[0]
    body["metadata"] = metadata
    return body


def _with_warnings(body: Json, warnings: Sequence[str]) -> Json:
    if warnings:
        body["warnings"] = list(warnings)
    return body


def models_list(model: str, created: int, max_model_len: int,
                tasks: Sequence[str] = ("generate",), root: str = "") -> Json:
    """GET /v1/models: the one served model, and what it serves (`generate`; `embed`
    and `score`; `classify`, and `score` with one label), as GetModelInfo.tasks says.
    `root` is the checkpoint it came from and `parent` the base model of an adapter
    (none: no adapters), as vLLM reports them; routers (llm-d, SGLang's gateway) read
    both to tell base models from adapters."""
    return {"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "corestream",
         "root": root or model, "parent": None, "max_model_len": max_model_len,
         "tasks": list(tasks)},
    ]}


def error_body(message: str, type: str, param: str | None = None,
               code: int | str | None = None) -> Json:
    """OpenAI's error envelope. `param` is the body field at fault, if one is."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
