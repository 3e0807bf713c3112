"""Tool calls out of a model's generated text: content, and calls with JSON arguments.

Each format is a small state machine over the raw text (special-token markers
included) that reads the same whether it gets the whole answer or deltas cut
anywhere, even inside a marker: `parse_whole` is `feed` then `finish`.

Streaming contract: a call is emitted when it is complete and well-formed, as one
`ToolCallDelta` with its index, id, name and all of its arguments (the shape of
OpenAI's first delta of a call; there is never a second). Nothing of a call is
emitted earlier, so a call that turns out malformed (bad JSON, no closing tag where
the model ended) has emitted nothing: its opening marker becomes content and the
text after it is read again as content. A call cut off by max_tokens
(`finish(cut=True)`) is no content: it is dropped, and the calls before it stand.
Content that could still be the start of a call's opening (a partial marker, and
the whitespace before it) is held back until the next delta decides it.

What is dropped: the whitespace between content and a call and between calls
(the newlines the models write around their markers); llama3's `;` separators.
Arguments are re-serialised compactly (`{"a":1}`, non-ASCII kept as is).
"""

from __future__ import annotations

import enum
import json
import random
import re
import string
from dataclasses import dataclass

from services.frontend.chat.parsers.markers import marker_prefix_length

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as compact JSON."""


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    """The call's position among this answer's calls."""
    id: str | None
    """Set, with `name`, on a call's first delta only (the parsers here send one)."""
    name: str | None
    arguments: str
    """A fragment; a call's fragments concatenate to its `ToolCall.arguments`."""


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class _Phase(enum.Enum):
    START = enum.auto()
    """llama3_json only: the answer may still open with a call."""
    CONTENT = enum.auto()
    """Plain text, looking for a call's opening marker."""
    OPENING = enum.auto()
    """After an opening marker: waiting for what follows it to show the call's form."""
    NAME = enum.auto()
    """mistral v11+: the function name before `[ARGS]`."""
    BODY = enum.auto()
    """Reading a call's JSON until it is complete."""
    BETWEEN = enum.auto()
    """After a complete call: separators, then content or the next call."""


def _held_before_marker(text: str, marker: str) -> int:
    """Length of the content tail to hold back: a partial marker and the whitespace
    before it, which is dropped if the marker completes."""
    partial = marker_prefix_length(text, marker)
    head = text[: len(text) - partial]
    return len(text) - len(head.rstrip())


def _loads(text: str) -> object:
    """The decoded JSON, or None when `text` is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_fields(
    obj: object, argument_keys: tuple[str, ...], require_arguments: bool = False
) -> tuple[str, str] | None:
    """(name, compact JSON arguments) of a decoded call, or None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None and require_arguments:
        return None
    arguments = obj[key] if key is not None else {}
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string, as the OpenAI API carries them.
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


class _JsonEnd:
    """Finds where the JSON object or array at `start` of a growing text ends.

    It only matches brackets outside strings; json.loads judges the complete text.
    Scanning resumes where it stopped, so a call streamed a token at a time costs
    linear time.
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is open."""
        for pos in range(self._pos, len(text)):
            char = text[pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = pos + 1
                    return pos + 1
        self._pos = len(text)
        return None


class ToolParser:
    """Streams one answer's content and tool calls apart.

    Subclasses implement `_step`. While a call is read, `_buffer` keeps its text
    unconsumed from the end of the opening marker, and `_raw` holds the opening
    (with the whitespace before it), so a rejected call is its own text again.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        # A seeded Random makes the ids deterministic (tests); by default they are
        # drawn from the OS.
        self._rng = rng if rng is not None else random.SystemRandom()
        self._phase = _Phase.CONTENT
        self._buffer = ""
        self._raw = ""
        self._json_end = _JsonEnd(0)
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._cut = False

    @property
    def calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return list(self._calls)

    def feed(self, delta: str) -> ParsedDelta:
        self._buffer += delta
        return self._advance(final=False)

    def finish(self, cut: bool = False) -> ParsedDelta:
        """The answer has ended: held text is released, and an unfinished call is
        content, or with `cut` (max_tokens ended the answer) dropped."""
        self._cut = cut
        return self._advance(final=True)

    def parse_whole(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole answer, by a fresh parser with this one's ids."""
        parser = type(self)(self._rng)
        head, tail = parser.feed(text), parser.finish()
        return head.content + tail.content, parser.calls

    def _advance(self, final: bool) -> ParsedDelta:
        while self._step(final):
            pass
        out = ParsedDelta("".join(self._content), tuple(self._deltas))
        self._content, self._deltas = [], []
        return out

    def _step(self, final: bool) -> bool:
        """Consume what the current phase can decide; True when the phase changed."""
        raise NotImplementedError

    def _new_id(self) -> str:
        return "call_" + "".join(self._rng.choices(_ALPHANUMERIC, k=24))

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _emit_call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        index = len(self._calls)
        call = ToolCall(call_id or self._new_id(), name, arguments)
        self._calls.append(call)
        self._deltas.append(ToolCallDelta(index, call.id, name, arguments))

    def _accept(self, end: int) -> None:
        """The call ending at `_buffer[end]` was emitted: drop its text."""
        self._buffer = self._buffer[end:]
        self._raw = ""
        self._phase = _Phase.BETWEEN

    def _reject(self) -> None:
        """The call being read is malformed: its opening is content, and the text after
        it is read again as content."""
        self._emit_content(self._raw)
        self._raw = ""
        self._phase = _Phase.CONTENT

    def _unfinished(self) -> None:
        """The answer ended inside the call being read: malformed if the model ended it,
        dropped (with all that follows its opening) if max_tokens cut it."""
        if not self._cut:
            self._reject()
            return
        self._raw = self._buffer = ""
        self._phase = _Phase.CONTENT

    def _scan_content(self, marker: str, final: bool) -> bool:
        """Emit content up to `marker`; True once the marker is found (it moves to `_raw`)."""
        start = self._buffer.find(marker)
        if start < 0:
            held = _held_before_marker(self._buffer, marker)
            if final and not (self._cut and marker_prefix_length(self._buffer, marker)):
                held = 0
            end = len(self._buffer) - held
            self._emit_content(self._buffer[:end])
            # At the end, what is still held is a marker cut by max_tokens: dropped.
            self._buffer = "" if final else self._buffer[end:]
            return False
        before = self._buffer[:start]
        text = before.rstrip()
        self._emit_content(text)
        self._raw = before[len(text) :] + marker
        self._buffer = self._buffer[start + len(marker) :]
        return True

    def _leave_call(self, separators: str | None = None) -> bool:
        """After a call: drop the whitespace (and `separators`) before what follows."""
        self._buffer = self._buffer.lstrip(separators)
        if not self._buffer:
            return False
        self._phase = _Phase.CONTENT
        return True

    def _open_json(self, at: int, final: bool, openers: str) -> bool:
        """Start reading the call's JSON, which must open with one of `openers` after
        the whitespace at `_buffer[at]`; anything else, or nothing, is malformed."""
        start = len(self._buffer) - len(self._buffer[at:].lstrip())
        if start == len(self._buffer):
            if final:
                self._unfinished()
            return final
        if self._buffer[start] in openers:
            self._json_end = _JsonEnd(start)
            self._phase = _Phase.BODY
        else:
            self._reject()
        return True

    def _read_json(self, final: bool) -> bool:
        """Emit the call(s) once their JSON is complete, or reject them."""
        end = self._json_end.scan(self._buffer)
        if end is None:
            if final:
                self._unfinished()
            return final
        calls = self._decode(self._buffer[self._json_end.start : end])
        if calls is None:
            self._reject()
            return True
        for name, arguments, call_id in calls:
            self._emit_call(name, arguments, call_id)
        self._accept(end)
        return True

    def _decode(self, text: str) -> list[tuple[str, str, str | None]] | None:
        """(name, arguments, id or None) of the calls in complete JSON; None if malformed."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Qwen2.5, Qwen3, Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    any number of them, after optional content."""

    START = "<tool_call>"
    END = "</tool_call>"

    def _step(self, final: bool) -> bool:
        if self._phase is _Phase.CONTENT:
            if not self._scan_content(self.START, final):
                return False
            self._phase = _Phase.BODY
            return True
        if self._phase is _Phase.BODY:
            end = self._buffer.find(self.END)
            if end < 0:
                if final:
                    self._unfinished()
                return final
            fields = _call_fields(_loads(self._buffer[:end]), ("arguments", "parameters"))
            if fields is None:
                self._reject()
            else:
                self._emit_call(*fields)
                self._accept(end + len(self.END))
            return True
        return self._leave_call()


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_CALL_ID_PART = r"(?:\[CALL_ID\]([A-Za-z0-9_\-]*))?"
# v11+ text between [TOOL_CALLS] and [ARGS]: a name, and in v11 only the call's id.
_NAME_SECTION = re.compile(rf"\s*([A-Za-z0-9_.\-]+){_CALL_ID_PART}\s*")
# What a name section may look like before it is complete: every prefix of a valid
# one matches, so a stream rejects a bad name early exactly when a whole parse would.
_NAME_SECTION_PREFIX = re.compile(rf"\s*[A-Za-z0-9_.\-]*{_CALL_ID_PART}\s*")


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then either a JSON list of `{"name", "arguments"}`
    (tokenizers up to v7), or `name[ARGS]{...}` per call (v11+; v11 also writes
    `name[CALL_ID]id[ARGS]{...}`). Ids are 9 alphanumerics, as Mistral's templates
    require; one the model wrote itself is kept when it has that form."""

    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        # Where in `_buffer` the call's JSON may begin: past the name section, if any.
        self._json_at = 0
        # The v11+ name (and v11 id) once read; None in the JSON-list form.
        self._name: str | None = None
        self._call_id: str | None = None

    def _new_id(self) -> str:
        return "".join(self._rng.choices(_ALPHANUMERIC, k=9))

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase is _Phase.CONTENT:
            if not self._scan_content(self.MARKER, final):
                return False
            self._json_at, self._name, self._call_id = 0, None, None
            self._phase = _Phase.OPENING
            return True
        if phase is _Phase.OPENING:
            return self._read_opening(final)
        if phase is _Phase.NAME:
            return self._read_name(final)
        if phase is _Phase.BODY:
            return self._read_json(final)
        return self._leave_call()

    def _read_opening(self, final: bool) -> bool:
        if self._name is not None:
            return self._open_json(self._json_at, final, "{")
        # Right after [TOOL_CALLS]: a JSON list (up to v7), else a v11+ name.
        if self._buffer.lstrip()[:1] in ("", "[", "{"):
            return self._open_json(0, final, "[{")
        self._phase = _Phase.NAME
        return True

    def _read_name(self, final: bool) -> bool:
        at = self._buffer.find(self.ARGS)
        if at < 0:
            partial = max(
                marker_prefix_length(self._buffer, self.ARGS),
                marker_prefix_length(self._buffer, self.CALL_ID),
            )
            head = self._buffer[: len(self._buffer) - partial]
            if not _NAME_SECTION_PREFIX.fullmatch(head):
                self._reject()
            elif final:
                self._unfinished()
            else:
                return False
            return True
        section = _NAME_SECTION.fullmatch(self._buffer[:at])
        if section is None:
            self._reject()
            return True
        self._name, self._call_id = section.group(1), section.group(2)
        self._json_at = at + len(self.ARGS)
        self._phase = _Phase.OPENING
        return True

    def _decode(self, text: str) -> list[tuple[str, str, str | None]] | None:
        decoded = _loads(text)
        if self._name is not None:
            fields = _call_fields({"name": self._name, "arguments": decoded}, ("arguments",))
            return None if fields is None else [(*fields, _mistral_id(self._call_id))]
        # Up to v7 a list; a lone object is taken as a list of one.
        items = decoded if isinstance(decoded, list) else [decoded]
        calls: list[tuple[str, str, str | None]] = []
        for item in items:
            fields = _call_fields(item, ("arguments", "parameters"))
            if fields is None:
                return None
            call_id = item.get("id") if isinstance(item, dict) else None
            calls.append((*fields, _mistral_id(call_id)))
        return calls or None


def _mistral_id(call_id: object) -> str | None:
    """A model-written id, when it has the form Mistral's templates require."""
    if isinstance(call_id, str) and _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return None


_LLAMA3_SEPARATORS = string.whitespace + ";"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: the whole answer is `{"name": ...,
    "parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`, several
    separated by `;` (or only by whitespace). Text that does not start that way is
    content; text after the calls is content too."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._phase = _Phase.START

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase is _Phase.START:
            body = self._buffer.lstrip()
            if body.startswith(self.PYTHON_TAG):
                opening = len(self._buffer) - len(body) + len(self.PYTHON_TAG)
                self._raw, self._buffer = self._buffer[:opening], self._buffer[opening:]
                self._phase = _Phase.OPENING
            elif body.startswith("{"):
                self._phase = _Phase.OPENING
            elif not final and self.PYTHON_TAG.startswith(body):
                return False  # "", or a prefix of the tag: the next delta decides
            elif self._cut and body and self.PYTHON_TAG.startswith(body):
                self._buffer = ""  # max_tokens cut the tag: a call's start, dropped
                return False
            else:
                self._phase = _Phase.CONTENT
            return True
        if phase is _Phase.OPENING:
            return self._open_json(0, final, "{")
        if phase is _Phase.BODY:
            return self._read_json(final)
        if phase is _Phase.BETWEEN:
            # `;` separators belong to the calls: dropped, like the whitespace around them.
            if not self._leave_call(_LLAMA3_SEPARATORS):
                return False
            if self._buffer.startswith("{"):
                self._phase = _Phase.OPENING
            return True
        self._emit_content(self._buffer)
        self._buffer = ""
        return False

    def _decode(self, text: str) -> list[tuple[str, str, str | None]] | None:
        fields = _call_fields(_loads(text), ("parameters", "arguments"), require_arguments=True)
        return None if fields is None else [(*fields, None)]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def make_tool_parser(name: str, rng: random.Random | None = None) -> ToolParser:
    try:
        parser_type = TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r} (known: {known})") from None
    return parser_type(rng)


def pick_tool_parser(template_source: str) -> str | None:
    """The tool parser for a chat template (`--tool-call-parser auto`), or None."""
    if "<function=" in template_source:
        # Qwen3-Coder writes XML calls inside <tool_call>: not a format we parse.
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and "tools" in template_source
    ):
        return "llama3_json"
    return None
