"""N-gram proposals (prompt lookup): the request's own tokens, continued as they went on
the last time its latest tokens appeared.

Answers that copy from their prompt (rewriting, extracting, editing a given file) repeat
long runs of it; so does code that repeats itself. The longest suffix of the request's
tokens, between prompt_lookup_max and prompt_lookup_min tokens long, that occurs earlier
in them is found, and the tokens that followed its latest earlier occurrence (the latest
followed by a whole proposal, if any is) are the proposal. No model runs: it costs a numpy
pass over the tokens, and a request with no match proposes nothing (and pays nothing).
"""

from __future__ import annotations

import numpy as np

from services.engine.request import Request


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        # Each request's tokens as an int64 array, grown as it generates (tokens never
        # change, so only the new ones are copied).
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Up to `num_tokens` proposed continuations of the request's tokens."""
        tokens = self._context(request)
        return propose_from(tokens, num_tokens, self.lookup_min, self.lookup_max)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _context(self, request: Request) -> np.ndarray:
        rid = request.request_id
        n = request.num_tokens
        buffer, length = self._tokens.get(rid, (np.empty(0, dtype=np.int64), 0))
        if length < n:
            if len(buffer) < n:
                grown = np.empty(max(2 * len(buffer), n + 256), dtype=np.int64)
                grown[:length] = buffer[:length]
                buffer = grown
            buffer[length:n] = request.token_slice(length, n)
            self._tokens[rid] = (buffer, n)
        return buffer[:n]


def propose_from(tokens: np.ndarray, num_tokens: int, lookup_min: int,
                 lookup_max: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (lookup_min to lookup_max long), at most `num_tokens` of them."""
    n = len(tokens)
    if n <= lookup_min or num_tokens < 1:
        return []
    # Candidates are the ends j of earlier occurrences (j < n - 1, so something follows)
    # of the suffix matched so far; each round extends the suffix one token to the left
    # and keeps the candidates that still match.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    best = ends if lookup_min <= 1 else None
    for length in range(2, min(lookup_max, n - 1) + 1):
        ends = ends[ends >= length - 1]
        ends = ends[tokens[ends - (length - 1)] == tokens[n - length]]
        if len(ends) == 0:
            break
        if length >= lookup_min:
            best = ends
    if best is None or len(best) == 0:
        return []
    # The latest occurrence, unless it is too near the end to be followed by a whole
    # proposal (a short loop) and an earlier one is not.
    whole = best[best <= n - 1 - num_tokens]
    start = int(whole[-1] if len(whole) else best[-1]) + 1
    return tokens[start : start + num_tokens].tolist()
