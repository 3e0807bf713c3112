"""Split a model's generated text into reasoning and content (`<think>...</think>` models).

The parsers see the raw text, special-token markers included, either whole or as
streamed deltas cut anywhere, even inside a marker. Text that could still be the
start of a marker is held back until the next delta decides it, so a client never
sees half a marker; `finish()` releases what is held when the answer ends.

The prompt may already open the reasoning: DeepSeek-R1 distills' generation prompt
ends with `<think>\\n`, Qwen3-2507 thinking models' too. The caller renders the
prompt, so it says so with `starts_in_reasoning` (see `prompt_opens_reasoning`).

What is stripped, as the models emit it (everything else is kept verbatim):
- newlines right after `<think>` (or at the start of reasoning the prompt opened),
- newlines right before `</think>`,
- newlines right after `</think>` (the models write `</think>\\n\\n` before the answer).
So an empty think block (`<think>\\n\\n</think>\\n\\n`) gives no reasoning at all.
Reasoning that never ends (cut by max_tokens) is all reasoning, newlines included.

A `<think>` opens reasoning only at the start of the output (after whitespace);
elsewhere, like a second `</think>`, it is text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from services.frontend.chat.parsers.markers import marker_prefix_length

THINK_START = "<think>"
THINK_END = "</think>"
_NEWLINES = "\r\n"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _State(enum.Enum):
    PREAMBLE = enum.auto()
    """Nothing decided yet: the output may still open with `<think>`."""
    REASONING_START = enum.auto()
    REASONING = enum.auto()
    CONTENT_START = enum.auto()
    CONTENT = enum.auto()


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """Streams `<think>` reasoning and the content after it apart; one per answer."""

    always_reasons: ClassVar[bool] = False
    """Whether output that does not open with `<think>` is still reasoning."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _State.PREAMBLE
        self._pending = ""

    def feed(self, delta: str) -> ReasoningDelta:
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        """Release what is held back; the answer has ended."""
        return self._advance(final=True)

    def parse_whole(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there is none, content) of a whole answer.

        Runs a fresh parser with this one's settings, so it is exactly what streaming
        the same text gives; this parser's own stream is untouched.
        """
        parser = type(self)(self.starts_in_reasoning)
        head, tail = parser.feed(text), parser.finish()
        return (head.reasoning + tail.reasoning) or None, head.content + tail.content

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(final, reasoning, content):
            pass
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _step(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the current state can decide; True when the state changed."""
        state = self._state
        if state is _State.PREAMBLE:
            body = self._pending.lstrip()
            if body.startswith(THINK_START):
                self._pending = body[len(THINK_START) :]
                self._state = _State.REASONING_START
                return True
            if not final and THINK_START.startswith(body):
                return False  # "", or a prefix of `<think>`: the next delta decides
            opens = self.starts_in_reasoning or self.always_reasons
            self._state = _State.REASONING_START if opens else _State.CONTENT
            return True
        if state is _State.REASONING_START or state is _State.CONTENT_START:
            self._pending = self._pending.lstrip(_NEWLINES)
            if not self._pending:
                return False
            self._state = _State.REASONING if state is _State.REASONING_START else _State.CONTENT
            return True
        if state is _State.REASONING:
            end = self._pending.find(THINK_END)
            if end >= 0:
                reasoning.append(self._pending[:end].rstrip(_NEWLINES))
                self._pending = self._pending[end + len(THINK_END) :]
                self._state = _State.CONTENT_START
                return True
            cut = len(self._pending) if final else len(self._pending) - self._undecided_tail()
            reasoning.append(self._pending[:cut])
            self._pending = self._pending[cut:]
            return False
        content.append(self._pending)
        self._pending = ""
        return False

    def _undecided_tail(self) -> int:
        """Length of the reasoning tail that a `</think>` may yet follow: a partial
        marker and the newlines before it, which are stripped if the marker comes."""
        partial = marker_prefix_length(self._pending, THINK_END)
        head = self._pending[: len(self._pending) - partial]
        return len(self._pending) - len(head.rstrip(_NEWLINES))


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: the answer always starts with reasoning.

    The distills' prompt opens `<think>`; the original R1 template leaves it to the
    model, which sometimes omits it. Either way everything before `</think>` is
    reasoning, whatever `starts_in_reasoning` says.
    """

    always_reasons = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 and QwQ: reasoning only when the prompt or the output opens `<think>`.

    With enable_thinking false the prompt carries an empty, closed think block and
    the whole output is content; the original Qwen3 template lets the model write
    `<think>` itself, the 2507 thinking models' prompt opens it.
    """


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def make_reasoning_parser(name: str, starts_in_reasoning: bool) -> ReasoningParser:
    try:
        parser_type = REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None
    return parser_type(starts_in_reasoning)
