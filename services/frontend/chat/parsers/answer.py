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
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 max_calls: int | None = None) -> None:
        """`max_calls`: the calls to report at most (1 under `parallel_tool_calls:
        false`); a model that writes more has the rest dropped, not made content."""
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls

    @property
    def calls(self) -> list[ToolCall]:
        calls = self._tools.calls if self._tools is not None else []
        return calls[: self._max_calls]

    def feed(self, text: str) -> AnswerDelta:
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        return _join(split.reasoning, self._content(split.content, final=False))

    def finish(self, cut: bool = False) -> AnswerDelta:
        """The rest of the answer; `cut`: max_tokens ended it, and a tool call it cut
        off is dropped rather than shown as content (see tools.py)."""
        if self._reasoning is None:
            return self._content("", final=True, cut=cut)
        split = self._reasoning.finish()
        return _join(split.reasoning, self._content(split.content, final=True, cut=cut))

    def finish_reason(self, engine_reason: int) -> int:
        """The chat finish reason of a sample the engine ended with `engine_reason`."""
        if engine_reason == common_pb2.FINISH_REASON_LENGTH:
            return chat_pb2.CHAT_FINISH_REASON_LENGTH
        if engine_reason == common_pb2.FINISH_REASON_ABORT:
            return chat_pb2.CHAT_FINISH_REASON_ABORT
        if engine_reason == common_pb2.FINISH_REASON_PAUSED:
            return chat_pb2.CHAT_FINISH_REASON_PAUSED
        if engine_reason == common_pb2.FINISH_REASON_SCHEMA_MISMATCH:
            return chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH
        if engine_reason in _ENDED and self.calls:
            return chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS
        return chat_pb2.CHAT_FINISH_REASON_STOP

    def _content(self, text: str, final: bool, cut: bool = False) -> AnswerDelta:
        if self._tools is None:
            return AnswerDelta(content=text)
        delta = AnswerDelta()
        if text:
            delta += _from_tools(self._tools.feed(text), self._max_calls)
        if final:
            delta += _from_tools(self._tools.finish(cut), self._max_calls)
        return delta


def _from_tools(parsed: ParsedDelta, max_calls: int | None) -> AnswerDelta:
    calls = parsed.tool_calls
    if max_calls is not None:
        calls = tuple(call for call in calls if call.index < max_calls)
    return AnswerDelta(content=parsed.content, tool_calls=calls)


def _join(reasoning: str, rest: AnswerDelta) -> AnswerDelta:
    return AnswerDelta(reasoning=reasoning) + rest
