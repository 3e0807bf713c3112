"""Which part of each checkpoint tensor a tensor-parallel rank reads: the one place that
knows, per parameter name, how the model is sharded (`tp_layers` builds the layers of
the matching shapes).

The rules go by the checkpoint's tensor name (after the family's renames), before the
loader packs q/k/v, gate/up or experts: each part is sliced on its own, then the
slices are concatenated, so a fused projection holds [q_r; k_r; v_r] of rank r.

- column-parallel (output rows, dim 0): q by query heads; k and v by KV heads, or the
  one KV head a rank's query heads use when there are fewer KV heads than ranks;
  gate/up of dense MLPs, of the shared expert and of every expert (Mixtral's w1, w3);
  their biases alike;
- row-parallel (input columns, dim 1): o_proj, down_proj and Mixtral's w2; their
  biases stay whole, since the layer adds them once, after the all-reduce;
- vocabulary (dim 0, zero-padded to a multiple of the ranks): embed_tokens, lm_head;
- everything else is replicated: norms, q/k norms, the router and the shared expert's
  gate.

A tensor is read through `safe_open(...).get_slice`, so a rank never materialises more
than its shard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.tp_layers import kv_heads_of_rank, split_evenly, vocab_rows

_VOCAB, _Q_HEADS, _KV_HEADS, _ROWS, _COLUMNS = "vocab", "q_heads", "kv_heads", "rows", "columns"

# The first matching rule decides; a name matching none is replicated.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$"), _VOCAB),
    (re.compile(r"\.q_proj\.(weight|bias)$"), _Q_HEADS),
    (re.compile(r"\.[kv]_proj\.(weight|bias)$"), _KV_HEADS),
    (re.compile(r"\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$"), _ROWS),
    (re.compile(r"\.(o_proj|down_proj|w2)\.weight$"), _COLUMNS),
)


class Sliceable(Protocol):
    """A tensor to slice: a torch.Tensor, or a safetensors slice (`get_slice`)."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Shard:
    """Indices `[start, stop)` along `dim`, zero-padded to `size` (the vocabulary)."""

    dim: int
    start: int
    stop: int
    size: int


class ShardPlan:
    """The shard of every checkpoint tensor that rank `rank` of `world_size` holds."""

    def __init__(self, config: DecoderConfig, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.head_dim = config.head_dim
        self.q_heads = split_evenly(config.num_attention_heads, world_size,
                                    "num_attention_heads")
        self.kv_heads = kv_heads_of_rank(config.num_key_value_heads, rank, world_size)

    def shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """What of tensor `name` of `shape` this rank holds; None: all of it."""
        rule = next((rule for pattern, rule in _RULES if pattern.search(name)), None)
        if rule is None:
            return None
        if rule == _VOCAB:
            rows = vocab_rows(shape[0], self.world_size)
            start = min(self.rank * rows, shape[0])
            return Shard(0, start, min(start + rows, shape[0]), rows)
        if rule == _Q_HEADS:
            rows = self.q_heads * self.head_dim
            return Shard(0, self.rank * rows, (self.rank + 1) * rows, rows)
        if rule == _KV_HEADS:
            start, stop = self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim
            return Shard(0, start, stop, stop - start)
        dim = 0 if rule == _ROWS else 1
        size = split_evenly(shape[dim], self.world_size, f"dim {dim} of {name}")
        return Shard(dim, self.rank * size, (self.rank + 1) * size, size)

    def read(self, name: str, source: Sliceable, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of tensor `name` (`shape`) from `source`, reading only it."""
        shard = self.shard(name, shape)
        if shard is None:
            return source[:]
        part = slice(shard.start, shard.stop)
        tensor = source[part] if shard.dim == 0 else source[:, part]
        missing = shard.size - (shard.stop - shard.start)
        if missing:
            tensor = torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])
        return tensor
