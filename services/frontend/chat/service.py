"""ChatService: the gRPC door onto chat answering (answering.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_pb2_grpc

from services.frontend.chat.answering import ChatAnswering
from services.frontend.collect import collect_chat
from services.frontend.errors import RequestError, to_status
from services.frontend.grpc_calls import aborting_on_error, call_metadata, start_call

SERVICE_NAME = chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name


class ChatServicer(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self, answering: ChatAnswering) -> None:
        self._answering = answering

    async def RenderChat(
        self, request: chat_pb2.RenderChatRequest, context: grpc.aio.ServicerContext
    ) -> chat_pb2.RenderChatResponse:
        try:
            rendered = await self._answering.render(request)
        except RequestError as e:
            await context.abort_with_status(to_status(e))
        return chat_pb2.RenderChatResponse(prompt=rendered.prompt, token_ids=rendered.token_ids)

    async def ChatStream(
        self, request: chat_pb2.ChatStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[chat_pb2.ChatStreamResponse]:
        request_id = await start_call(request.request_id, context)
        async for response in aborting_on_error(
                self._answering.answer(request_id, request, call_metadata(context)), context):
            yield response

    async def Chat(
        self, request: chat_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> chat_pb2.ChatResponse:
        request_id = await start_call(request.request_id, context)
        responses = self._answering.answer(request_id, request, call_metadata(context))
        return await collect_chat(request_id, aborting_on_error(responses, context))
