"""Whole responses out of streamed ones, for the unary RPCs (Generate, Chat) and the
HTTP API's answers that do not stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2


async def collect_generate(
    request_id: str, chunks: AsyncIterator[generate_pb2.GenerateStreamResponse]
) -> generate_pb2.GenerateResponse:
    """A whole GenerateResponse out of a request's chunks."""
    response = generate_pb2.GenerateResponse(request_id=request_id)
    completions: dict[int, generate_pb2.Completion] = {}
    texts: dict[int, list[str]] = {}
    async for chunk in chunks:
        completion = completions.setdefault(
            chunk.index, generate_pb2.Completion(index=chunk.index))
        texts.setdefault(chunk.index, []).append(chunk.text)
        completion.token_ids.extend(chunk.token_ids)
        completion.logprobs.extend(chunk.logprobs)
        if chunk.token_ids and chunk.weight_version:
            completion.first_weight_version = (completion.first_weight_version
                                               or chunk.weight_version)
            completion.weight_version = chunk.weight_version
        response.prompt_logprobs.extend(chunk.prompt_logprobs)
        response.warnings.extend(chunk.warnings)
        if chunk.finish_reason:
            completion.finish_reason = chunk.finish_reason
            stop = chunk.WhichOneof("matched_stop")
            if stop is not None:
                setattr(completion, stop, getattr(chunk, stop))
        if chunk.HasField("usage"):
            response.usage.CopyFrom(chunk.usage)
    for index in sorted(completions):
        completions[index].text = "".join(texts[index])
        response.completions.append(completions[index])
    return response


async def collect_chat(
    request_id: str, responses: AsyncIterator[chat_pb2.ChatStreamResponse]
) -> chat_pb2.ChatResponse:
    """A whole ChatResponse out of an answer's deltas."""
    response = chat_pb2.ChatResponse(request_id=request_id)
    choices: dict[int, chat_pb2.ChatChoice] = {}
    texts: dict[int, tuple[list[str], list[str]]] = {}
    async for delta in responses:
        choice = choices.setdefault(delta.index, chat_pb2.ChatChoice(index=delta.index))
        content, reasoning = texts.setdefault(delta.index, ([], []))
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        choice.logprobs.extend(delta.logprobs)
        if delta.weight_version:
            choice.first_weight_version = choice.first_weight_version or delta.weight_version
            choice.weight_version = delta.weight_version
        for call in delta.tool_calls:
            if call.id:  # a call's first delta
                choice.tool_calls.add(id=call.id, name=call.name)
            choice.tool_calls[call.index].arguments += call.arguments
        if delta.finish_reason:
            choice.finish_reason = delta.finish_reason
        if delta.HasField("usage"):
            response.usage.CopyFrom(delta.usage)
        response.warnings.extend(delta.warnings)
    for index in sorted(choices):
        content, reasoning = texts[index]
        choices[index].content = "".join(content)
        choices[index].reasoning = "".join(reasoning)
        response.choices.append(choices[index])
    return response
