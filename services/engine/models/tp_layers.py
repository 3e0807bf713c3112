"""Tensor-parallel layers: the pieces of a decoder sharded over the ranks of a TP group.

The split follows Megatron-LM: a column-parallel matmul (output features split, input
replicated) feeds a row-parallel one (input features split), whose partial products
one all-reduce sums. So each decoder layer costs two all-reduces, one after o_proj and
one after down_proj (or after the whole MoE block), and nothing else:

- q/k/v and gate/up are column-parallel. They need no class of their own: a plain
  `Linear` of this rank's width, loaded with this rank's rows (`tp_sharding`).
  Attention is per head, so a rank attends with its query heads over its KV heads,
  and its KV cache holds only those (`local_kv_heads`).
- o_proj and down_proj are `RowParallelLinear`: the bias, held whole by every rank, is
  added once, after the reduce.
- The embedding and lm_head split the vocabulary (padded to a multiple of the ranks):
  the embedding gives zeros for ids outside this rank's rows and is all-reduced; the
  head all-gathers the logit slices, so rank 0 samples from the full logits.

With a group of one rank (or none) the models build none of these: they run today's
modules, and no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from corestream_kernels.cpu_linear import linear
from torch import nn

from services.engine.models.linear import Linear
from services.engine.parallel.tp_group import TPGroup


def sharding_group(group: TPGroup | None) -> TPGroup | None:
    """`group` if it has more than one rank; None, i.e. nothing to shard, otherwise."""
    return group if group is not None and group.world_size > 1 else None


def split_evenly(total: int, world_size: int, what: str) -> int:
    """`total / world_size`, or a ValueError naming `what` when it does not divide."""
    if total % world_size:
        raise ValueError(
            f"{what} {total} is not divisible by tensor_parallel_size {world_size}: "
            f"choose a tensor_parallel_size that divides it"
        )
    return total // world_size


def kv_heads_of_rank(num_kv_heads: int, rank: int, world_size: int) -> range:
    """The KV heads rank `rank` holds: an equal share when there are at least as many KV
    heads as ranks, else the one KV head its query heads attend with (replicated)."""
    if num_kv_heads >= world_size:
        per_rank = split_evenly(num_kv_heads, world_size, "num_key_value_heads")
        return range(rank * per_rank, (rank + 1) * per_rank)
    if world_size % num_kv_heads:
        # Otherwise some rank's query heads would span two KV heads' groups.
        raise ValueError(
            f"num_key_value_heads {num_kv_heads} is below tensor_parallel_size "
            f"{world_size} and does not divide it: choose a tensor_parallel_size that "
            f"divides or is a multiple of {num_kv_heads}"
        )
    head = rank * num_kv_heads // world_size
    return range(head, head + 1)


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of each rank's vocabulary shard: the vocabulary padded to a multiple of
    `world_size`, split evenly."""
    return -(-vocab_size // world_size)


def all_reduce(group: TPGroup, x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the ranks (in place when contiguous)."""
    # Every rank runs the same batch, so either all skip an empty step or none does.
    if x.numel() == 0:
        return x
    return group.all_reduce(x.contiguous())


class RowParallelLinear(Linear):
    """`y = x @ W.T + b` with W's input features split over the ranks.

    `weight` `[out, in / N]` is this rank's columns; x `[T, in / N]` is the matching
    part of the input, which the column-parallel layer before produced.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self.group, linear(x, self.weight, panels=self.panels))
        if self.bias is not None:
            out += self.bias
        return out


def row_linear(
    in_features: int, out_features: int, bias: bool, group: TPGroup | None
) -> Linear:
    """A row-parallel linear layer under `group`; a plain one without it."""
    if group is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (token ids) are split over the ranks.

    `weight` `[ceil(vocab / N), hidden]`: ids `[r * rows, (r + 1) * rows)` on rank r,
    the last rank's tail zero padding.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        rows = vocab_rows(vocab_size, group.world_size)
        self.first = group.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        # Exactly one rank holds each id, so the sum over ranks is its embedding.
        return all_reduce(self.group, x.masked_fill_(elsewhere.unsqueeze(-1), 0))


class VocabParallelLMHead(Linear):
    """The output projection with its vocabulary split like `VocabParallelEmbedding`
    (so tied embeddings share one shard); its forward returns the FULL float32 logits
    `[T, vocab]`, all-gathered, on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, group: TPGroup) -> None:
        super().__init__(hidden_size, vocab_rows(vocab_size, group.world_size), bias=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_rows = hidden_states.shape[0]
        local = linear(hidden_states, self.weight, panels=self.panels)  # [T, rows]
        if num_rows == 0:
            return local.new_empty((0, self.vocab_size), dtype=torch.float32)
        # Gathered in the model's dtype (half the bytes of float32 for bfloat16), then
        # cast, as the unsharded head casts its output.
        gathered = self.group.all_gather(local)  # [N, T, rows]
        logits = gathered.permute(1, 0, 2).reshape(num_rows, -1).float()
        if logits.shape[1] != self.vocab_size:
            # Contiguous: the sampler's argmax over a strided view is far slower.
            logits = logits[:, : self.vocab_size].contiguous()
        return logits
