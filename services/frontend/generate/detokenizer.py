"""Incremental detokenization and stop-string matching for one streaming request.

Token ids arrive a few at a time; `IncrementalDetokenizer` turns them into text
deltas with the tokenizer's own streaming decoder, which waits for the bytes of a
multi-byte character to be complete. `StopStringMatcher` sits after it: it holds
back any tail of the text that could still grow into a stop string, so a client
never sees text that a later match would have cut away.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from services.frontend.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

# Prompt tokens fed to the stream decoder as context, so that the first generated
# token decodes as a continuation (e.g. keeps its leading space) rather than as the
# start of a text.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        # A context that ends inside a character (a prompt given as ids may) would
        # come out of the stream with the first generated text: leave that tail out.
        while context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """The text the new tokens complete; "" while a character is still partial."""
        pieces: list[str] = []
        for token_id in token_ids:
            try:
                piece = self._stream.step(self._tokenizer.backend, token_id)
            except Exception:  # an id beyond the tokenizer (padded vocab) has no text
                log.debug("token id %d has no text", token_id, exc_info=True)
                continue
            if piece:
                pieces.append(piece)
        return "".join(pieces)


class StopStringMatcher:
    """Finds the first stop string in streamed text; emits only text that is final."""

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str_in_output
        self._pending = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """(text safe to emit, matched stop string or None).

        `check=False` (before min_tokens) still holds back partial matches, so a
        stop that completes once checking starts is found whole.
        """
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, None
        if check:
            match = self._first_match()
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include else start
                out, self._pending = self._pending[:end], ""
                return out, stop
        hold = self._partial_match_length()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, None

    def flush(self) -> str:
        """Release held-back text when the request ends without a match."""
        out, self._pending = self._pending, ""
        return out

    def _first_match(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = self._pending.find(stop)
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _partial_match_length(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
