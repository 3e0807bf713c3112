"""The chat finish reason of each engine finish reason (AnswerParser.finish_reason)."""

from __future__ import annotations

import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2

from services.frontend.chat.parsers.answer import AnswerParser


@pytest.mark.parametrize(("engine_reason", "chat_reason"), [
    (common_pb2.FINISH_REASON_EOS_TOKEN, chat_pb2.CHAT_FINISH_REASON_STOP),
    (common_pb2.FINISH_REASON_STOP_STRING, chat_pb2.CHAT_FINISH_REASON_STOP),
    (common_pb2.FINISH_REASON_LENGTH, chat_pb2.CHAT_FINISH_REASON_LENGTH),
    (common_pb2.FINISH_REASON_ABORT, chat_pb2.CHAT_FINISH_REASON_ABORT),
    (common_pb2.FINISH_REASON_PAUSED, chat_pb2.CHAT_FINISH_REASON_PAUSED),
    (common_pb2.FINISH_REASON_SCHEMA_MISMATCH, chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH),
])
def test_finish_reason(engine_reason: int, chat_reason: int) -> None:
    assert AnswerParser(None, None).finish_reason(engine_reason) == chat_reason
