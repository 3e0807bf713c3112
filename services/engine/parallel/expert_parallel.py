"""ExpertParallel: an MoE layer's experts split over the DP ranks, and the token dispatch.

With N ranks and E experts, rank r owns experts [r*E/N, (r+1)*E/N) and loads only
those; attention and every other weight stay replicated, so each rank still runs its
own batch (data parallel) and only the expert MLPs see other ranks' tokens.

The dispatch is the simple one: all-gather every rank's tokens (sizes first, since ranks
schedule different batches, then rows padded to the largest), route them all and run the
local experts on the tokens routed to them, all-reduce the partial outputs (a token's
experts may sit on several ranks; the sum completes each token), and keep this rank's
rows. Every rank moves all N ranks' tokens twice per layer; an all-to-all that sends
each token only to its experts' ranks moves less, and is the next step if measurements
warrant it (benchmarks/moe_ep.py).

Token counts are the same in every layer of a forward, so a model exchanges them once
per forward (`forward_batch`); a dispatch outside one exchanges them itself.

A rank with nothing scheduled still dispatches, with zero tokens: the collectives of a
layer complete only when every rank joins them, so idle ranks run dummy batches
(`worker.dummy_batch`) in lockstep with the busy ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from services.engine.parallel.dp_group import DPGroup


class ExpertParallel:
    def __init__(self, group: DPGroup | None) -> None:
        """`group` None: a single rank that owns every expert and never communicates."""
        self.group = group
        self._batch_sizes: list[int] | None = None
        """Every rank's token count in the current forward, while one runs."""

    # Read from the group each time: a group re-formed without a rank numbers its ranks
    # afresh (services/engine/core/sentinel.py), and the experts move with them.
    @property
    def rank(self) -> int:
        return self.group.rank if self.group is not None else 0

    @property
    def world_size(self) -> int:
        return self.group.world_size if self.group is not None else 1

    def local_experts(self, num_experts: int) -> range:
        """The ids of the experts this rank owns."""
        if why := uneven_split(num_experts, self.world_size):
            raise ValueError(why + f"; choose a data-parallel size that divides {num_experts}")
        per_rank = num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @contextmanager
    def forward_batch(self, num_tokens: int, device: torch.device) -> Iterator[None]:
        """Scope of one forward over `num_tokens` tokens on this rank: learns every rank's
        count once, for all the layers' dispatches inside."""
        assert self._batch_sizes is None, "forward batches do not nest"
        if self.group is not None and self.world_size > 1:
            self._batch_sizes = self._gather_sizes(num_tokens, device)
        try:
            yield
        finally:
            self._batch_sizes = None

    def _gather_sizes(self, num_tokens: int, device: torch.device) -> list[int]:
        assert self.group is not None
        # NOTE: .tolist() waits for the gather; on CUDA that is a host sync.
        return self.group.all_gather(torch.tensor([num_tokens], device=device)).view(-1).tolist()

    def dispatch(
        self, x: torch.Tensor, run_local_experts: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The experts' output `[T, H]` for this rank's tokens `x` `[T, H]`.

        `run_local_experts` maps tokens `[M, H]` (every rank's, in rank order) to the sum
        of their local experts' weighted outputs `[M, H]`: zero rows for tokens routed
        to no local expert. Every rank must call this for the same layers in the same
        order, `T = 0` included.
        """
        group = self.group
        if group is None or group.world_size == 1:
            return run_local_experts(x)
        num_tokens, hidden = x.shape
        sizes = self._batch_sizes or self._gather_sizes(num_tokens, x.device)
        assert sizes[self.rank] == num_tokens, "tokens differ from the forward batch's"
        # At least one row: a collective over empty tensors is not every backend's case.
        rows = max(1, max(sizes))
        padded = x.new_zeros((rows, hidden))
        padded[:num_tokens] = x
        gathered = group.all_gather(padded)  # [N, rows, H]
        if min(sizes) == rows:
            tokens = gathered.view(-1, hidden)
        else:
            tokens = torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])
        partial = run_local_experts(tokens)
        if min(sizes) == rows:
            out = partial.view(group.world_size, rows, hidden).contiguous()
        else:
            out = x.new_zeros((group.world_size, rows, hidden))
            for r, chunk in enumerate(partial.split(sizes)):
                out[r, : sizes[r]] = chunk
        group.all_reduce(out)
        return out[self.rank, :num_tokens]


def uneven_split(num_experts: int, world_size: int) -> str | None:
    """Why `num_experts` cannot be split over `world_size` ranks; None if it can."""
    if num_experts % world_size:
        return (f"num_experts {num_experts} is not divisible by the data-parallel size "
                f"{world_size}: expert parallelism gives every rank the same number of "
                "experts")
    return None
