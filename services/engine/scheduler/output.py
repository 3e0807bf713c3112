"""What the scheduler hands the model runner each step.

Flow: the scheduler decides which requests advance and by how many tokens, and
describes each as a `ScheduledRequest`; the model runner flattens them into one
batch (tokens, positions, slot mapping, block tables), runs one forward pass,
samples the requests whose chunk reaches the end of their known tokens, and
returns a `RunnerOutput`: the sampled token of each, plus logprobs for the
requests that asked. The scheduler then updates its state from it. No torch here:
this module is shared by plain-Python code.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from services.common.pooling import PoolingParams
from services.common.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: Sequence[int]
    """Tokens to feed this step: a chunk of the prompt, or the last sampled token."""
    start_pos: int
    """Tokens of this request already in the KV cache; the position of token_ids[0]."""
    block_ids: Sequence[int]
    """The request's whole block table (covers start_pos + len(token_ids) tokens)."""
    sample: bool
    """The chunk ends at the last known token: sample the next token from its logits."""
    sampling: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far (penalties, min_tokens and the per-step seed use them)."""
    eos_token_ids: Sequence[int] = ()
    """The model's EOS ids; masked with stop_token_ids while under min_tokens."""
    prompt_logprobs: int | None = None
    """Alternatives per prompt position to report for this chunk; None: no prompt
    logprobs (also once they have been reported, e.g. when recomputing after a
    preemption)."""
    attempt: int = 0
    """The request's preemption count when this was scheduled: the outputs of a batch
    that was in flight when its request got preempted belong to an earlier attempt
    and are dropped."""
    pooling: PoolingParams | None = None
    """A pooling request's chunk: the runner pools its hidden states (the result comes
    with the chunk that ends the prompt, `sample`) and samples nothing."""
    num_draft_tokens: int = 0
    """Speculative decoding: the last `num_draft_tokens` of token_ids are proposed
    continuations, not the request's tokens yet. The runner samples at every position
    (as if each draft before it had been generated) and keeps the drafts up to the
    first one its own sample disagrees with (`RunnerOutput.verified`)."""
    num_lookahead: int = 0
    """A draft model's proposals wanted after this step: the runner's draft model
    continues the request's tokens (the new ones included) greedily by this many
    (`RunnerOutput.draft_tokens`); block_ids cover those positions too."""


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """The allowed next tokens of a step's constrained sampled requests, being built
    on the mask thread (structured/step_mask.py) while the model runs."""

    request_ids: tuple[str, ...]
    """The requests in row order; a request with draft tokens has a row per position
    (the mask after each draft before it), consecutive."""
    bitmask: Future[Any]
    """An int32 numpy array [len(request_ids), ceil(vocab / 32)]: bit t % 32 of word
    t // 32 set means token t is allowed."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: Sequence[ScheduledRequest]
    finished_request_ids: frozenset[str] = field(default_factory=frozenset)
    """Requests that ended since the last step; the runner drops any state it keeps."""
    grammar_mask: GrammarMask | None = None
    """Set by the engine core when any sampled request has an output constraint."""
    step: int = 0
    """The scheduler's step counter when it made this batch."""

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """Log-probabilities at one position, from log_softmax of the model's raw logits."""

    token_id: int
    """The chosen token: the sampled one, or the prompt's next token."""
    logprob: float
    rank: int
    """1 for the most likely token."""
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the most likely tokens, most likely first."""


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    """The next token of each request that sampled."""
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    """For sampled requests with sampling.logprobs set: their new token's logprobs."""
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    """For chunks with prompt_logprobs set: position p's logprobs of prompt token
    p + 1, for each prompt position p of the chunk that has a next prompt token."""
    verified: dict[str, list[int]] = field(default_factory=dict)
    """For requests with draft tokens (in place of `sampled`): the drafts accepted, in
    order, then the token sampled where the first rejected draft was (or after the
    last draft): 1 to num_draft_tokens + 1 new tokens."""
    verified_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    """For those of them with sampling.logprobs set: one per token of `verified`."""
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)
    """For requests with num_lookahead: the draft model's proposals for their next step,
    continuing their tokens after this step's new ones."""
    pooled: dict[str, tuple[bytes, tuple[int, ...]]] = field(default_factory=dict)
    """For pooling requests whose prompt ended this step: float32 values and shape."""
    forward_s: float = 0.0
    """Seconds the runner spent in the forward pass (on a GPU, until the sampler's
    first read of the logits waits for it: part of it then counts as sampling)."""
    sample_s: float = 0.0
    """Seconds spent sampling (and computing logprobs) after the forward."""
