"""One sample's generated text, read as a chat answer: reasoning, content, tool calls.

The reasoning parser reads first (a tool call inside reasoning is thinking, not a
call); what it passes on as content goes through the tool parser. Both hold back
text that may still turn out to be a marker, so a delta out of here may lag the
text in; `finish` releases the rest when the sample ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2

from services.frontend.chat.parsers.reasoning import ReasoningParser
from services.frontend.chat.parsers.tools import ParsedDelta, ToolCall, ToolCallDelta, ToolParser

# The engine's reasons that mean the model (or its constraint) ended the answer.
_ENDED = (
    common_pb2.FINISH_REASON_EOS_TOKEN,
    common_pb2.FINISH_REASON_STOP_TOKEN,
    common_pb2.FINISH_REASON_STOP_STRING,
    common_pb2.FINISH_REASON_STOP,
)


@dataclass(frozen=True, slots=True)
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, later: AnswerDelta) -> AnswerDelta:
        return AnswerDelta(self.reasoning + later.reasoning, self.content + later.content,
                           self.tool_calls + later.tool_calls)


class AnswerParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> AnswerDelta:
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        return _join(split.reasoning, self._content(split.content, final=False))

    def finish(self) -> AnswerDelta:
        if self._reasoning is None:
            return self._content("", final=True)
        split = self._reasoning.finish()
        return _join(split.reasoning, self._content(split.content, final=True))

    def finish_reason(self, engine_reason: int) -> int:
        """The chat finish reason of a sample the engine ended with `engine_reason`."""
        if engine_reason == common_pb2.FINISH_REASON_LENGTH:
            return chat_pb2.CHAT_FINISH_REASON_LENGTH
        if engine_reason == common_pb2.FINISH_REASON_ABORT:
            return chat_pb2.CHAT_FINISH_REASON_ABORT
        if engine_reason == common_pb2.FINISH_REASON_SCHEMA_MISMATCH:
            return chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH
        if engine_reason in _ENDED and self.calls:
            return chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS
        return chat_pb2.CHAT_FINISH_REASON_STOP

    def _content(self, text: str, final: bool) -> AnswerDelta:
        if self._tools is None:
            return AnswerDelta(content=text)
        delta = AnswerDelta()
        if text:
            delta += _from_tools(self._tools.feed(text))
        if final:
            delta += _from_tools(self._tools.finish())
        return delta


def _from_tools(parsed: ParsedDelta) -> AnswerDelta:
    return AnswerDelta(content=parsed.content, tool_calls=parsed.tool_calls)


def _join(reasoning: str, rest: AnswerDelta) -> AnswerDelta:
    return AnswerDelta(reasoning=reasoning) + rest
