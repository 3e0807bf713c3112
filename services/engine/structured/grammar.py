"""One constrained request's grammar state: an llguidance matcher that has consumed
every token the request has generated, so its mask says what may come next."""

from __future__ import annotations

import llguidance


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
        return str(self.matcher.get_error())
