"""Speculator: the scheduler's source of draft tokens, and when to ask it for none.

The scheduler asks for drafts for each decoding request it schedules; the runner
verifies them in the step's forward (`ScheduledRequest.num_draft_tokens`), and the
scheduler reports back how many were accepted. Proposers are a seam (`Proposer`):
n-gram lookup runs here, at schedule time; a draft model runs in the model runner,
which proposes after a step for the requests the scheduler asked it to
(`ScheduledRequest.num_lookahead`), and its drafts wait here (`RunnerDrafts`) for the
request's next step. EAGLE-style heads would plug in the same way.

When it does not pay, it proposes nothing:
- in a step with more than `disable_by_batch_size` running requests (a big batch is
  bound by compute, not by reading the weights once, so verifying drafts is not free);
- for a request whose recent drafts were mostly rejected: an exponential moving
  average (weight 1/2) of its accepted fraction per verify step below
  `min_acceptance_rate` makes it skip its next 4 decode steps without drafts, then 8,
  16, up to 64 while it stays low; one good verify step resets that to 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.engine.request import Request
from services.engine.speculative.config import SpeculativeConfig
from services.engine.speculative.ngram import NgramProposer

_FIRST_BACKOFF = 4
_MAX_BACKOFF = 64


class RunnerDrafts:
    """Drafts the model runner proposed after a step, each for the request as it stood
    then (its number of tokens): valid only while the request has not moved on."""

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def store(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        self._drafts[request_id] = (num_tokens, drafts)

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        stored = self._drafts.pop(request.request_id, None)
        if stored is None or stored[0] != request.num_tokens:
            return []
        return stored[1][:num_tokens]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)


class Proposer(Protocol):
    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens that may continue the request's tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept for it."""
        ...


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    num_drafts: int = 0
    """Verify steps of requests that had drafts."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    """How often the draft at position i (0 first) was accepted."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields per request on average: the accepted drafts and
        the target's own token (1.0 with no drafts)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)


@dataclass(slots=True)
class _Acceptance:
    rate: float = 1.0
    skip: int = 0
    backoff: int = _FIRST_BACKOFF


@dataclass(slots=True)
class _Counts:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.runner_drafts = RunnerDrafts() if config.method == "draft_model" else None
        self.proposer: Proposer = proposer or self.runner_drafts or NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max)
        self._acceptance: dict[str, _Acceptance] = {}
        self._counts = _Counts(per_position=[0] * config.num_speculative_tokens)

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests proposes at all."""
        return num_running <= self.config.disable_by_batch_size

    def propose(self, request: Request, limit: int) -> list[int]:
        """Drafts for the request's next step, at most `limit` (what its budget, blocks
        and max_tokens leave) and num_speculative_tokens."""
        num_tokens = min(limit, self.config.num_speculative_tokens)
        if num_tokens < 1:
            return []
        if self.runner_drafts is None and self._skips(request.request_id):
            return []
        return self.proposer.propose(request, num_tokens)

    def lookahead(self, request: Request) -> int:
        """How many drafts the model runner should propose for the request after this
        step (a draft model's): 0 while the request skips for its low acceptance."""
        if self.runner_drafts is None or self._skips(request.request_id):
            return 0
        return self.config.num_speculative_tokens

    def _skips(self, request_id: str) -> bool:
        """Whether the request sits out this step (and counts it)."""
        state = self._acceptance.get(request_id)
        if state is not None and state.skip > 0:
            state.skip -= 1
            return True
        return False

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step's outcome for one request."""
        counts = self._counts
        counts.num_drafts += 1
        counts.num_draft_tokens += num_drafts
        counts.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            counts.per_position[i] += 1
        state = self._acceptance.setdefault(request_id, _Acceptance())
        state.rate = 0.5 * state.rate + 0.5 * (num_accepted / num_drafts)
        if state.rate < self.config.min_acceptance_rate:
            state.skip = state.backoff
            state.backoff = min(2 * state.backoff, _MAX_BACKOFF)
            state.rate = self.config.min_acceptance_rate  # a fresh chance after the skip
        else:
            state.backoff = _FIRST_BACKOFF

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)

    def stats(self) -> SpeculationStats:
        c = self._counts
        return SpeculationStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                tuple(c.per_position))
