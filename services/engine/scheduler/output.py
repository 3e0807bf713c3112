"""What the scheduler hands the model runner each step.

Flow: the scheduler decides which requests advance and by how many tokens, and
describes each as a `ScheduledRequest`; the model runner flattens them into one
batch (tokens, positions, slot mapping, block tables), runs one forward pass,
samples the requests whose chunk reaches the end of their known tokens, and
returns `{request_id: sampled_token_id}`. The scheduler then updates its state
from that dict. No torch here: this module is shared by plain-Python code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: Sequence[ScheduledRequest]
    finished_request_ids: frozenset[str] = field(default_factory=frozenset)
    """Requests that ended since the last step; the runner drops any state it keeps."""

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
