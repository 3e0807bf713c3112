"""One constrained request's grammar state: an llguidance matcher that has consumed
every token the request has generated, so its mask says what may come next."""

from __future__ import annotations

import llguidance

# llguidance's error text ends with a dump of the parser state and the whole grammar
# (hundreds of kilobytes for a big schema): past gRPC's 16 KiB metadata limit, a client
# would get RESOURCE_EXHAUSTED from its own library instead of the message.
_MAX_ERROR_CHARS = 1000


class Grammar:
    """Owned by the busy loop (accept) and, for one step at a time, by the mask thread
    (the mask of a request is only built while its tokens are not being accepted)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (then the
        matcher is in its error state, see `error`)."""
        return bool(self.matcher.consume_token(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar would accept in a row (it
        is not advanced)."""
        return int(self.matcher.validate_tokens(tokens))

    def advance(self, tokens: list[int]) -> None:
        """Consume tokens known to be valid (the mask thread's look ahead at drafts)."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise ValueError(f"draft token {token} was not valid: {self.error}")

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` consumed."""
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise ValueError(f"could not roll back {num_tokens} tokens: {self.error}")

    @property
    def is_stopped(self) -> bool:
        """Nothing may follow: the grammar is complete (or ended by EOS)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        """The matcher's error, without its state and grammar dump."""
        text = str(self.matcher.get_error()).split("<state>", 1)[0].strip()
        return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."
