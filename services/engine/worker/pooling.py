"""Pooling: a pooling request's hidden states, chunk by chunk, into its one result.

A long prompt is prefilled over several steps (chunked prefill), so a request's pool is
built as its chunks come: MEAN adds each chunk's rows to a running sum, CLS keeps the
first row of the first chunk, ALL keeps every chunk's rows, LAST needs only the last
row of the last chunk. When the chunk that ends the prompt has run, the pool becomes the
result: a classifier's score head and activation, or an embedding truncated to the
request's dimensions and normalized. A chunk starting at position 0 starts the request
over (a preempted request recomputes from the start: only LAST pooling may reuse a cached
prefix, and it reads none of the earlier rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from services.common.pooling import Activation, Pooler, PoolingTask, PoolingType
from services.engine.scheduler.output import ScheduledRequest


@dataclass(slots=True)
class _Partial:
    """What a request's finished chunks left for its pool."""

    total: torch.Tensor | None = None
    count: int = 0
    first: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)


class PoolingHead:
    def __init__(self, pooler: Pooler, score: nn.Module | None) -> None:
        """`score`: a classifier's head (hidden -> num_labels)."""
        if pooler.task is PoolingTask.CLASSIFY and score is None:
            raise ValueError("a classifier needs its score head")
        self.pooler = pooler
        self._score = score
        self._partial: dict[str, _Partial] = {}

    def pool(self, hidden: torch.Tensor, requests: Sequence[ScheduledRequest],
             query_start_loc: Sequence[int]) -> dict[str, tuple[bytes, tuple[int, ...]]]:
        """Take a forward's hidden states `[T, H]` (request i's rows from
        `query_start_loc[i]`); the result of every request whose prompt ended."""
        results: dict[str, tuple[bytes, tuple[int, ...]]] = {}
        for i, sr in enumerate(requests):
            params = sr.pooling
            assert params is not None and params.pooling_type is not None
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]]
            kind = params.pooling_type
            if sr.start_pos == 0 or sr.request_id not in self._partial:
                self._partial[sr.request_id] = _Partial()
            partial = self._partial[sr.request_id]
            if kind is PoolingType.MEAN:
                chunk = rows.sum(dim=0, dtype=torch.float32)
                partial.total = chunk if partial.total is None else partial.total + chunk
                partial.count += rows.shape[0]
            elif kind is PoolingType.CLS and sr.start_pos == 0:
                partial.first = rows[0].float()
            elif kind is PoolingType.ALL:
                partial.rows.append(rows.float())
            if not sr.sample:
                continue
            del self._partial[sr.request_id]
            if kind is PoolingType.LAST:
                pooled = rows[-1].float()
            elif kind is PoolingType.MEAN:
                assert partial.total is not None
                pooled = partial.total / partial.count
            elif kind is PoolingType.CLS:
                assert partial.first is not None
                pooled = partial.first
            else:
                pooled = torch.cat(partial.rows)
            values = self._finish(pooled, sr)
            results[sr.request_id] = (values.contiguous().cpu().numpy().tobytes(),
                                      tuple(values.shape))
        return results

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended (finished, aborted): their partial pools go."""
        for request_id in request_ids:
            self._partial.pop(request_id, None)

    def _finish(self, pooled: torch.Tensor, sr: ScheduledRequest) -> torch.Tensor:
        params = sr.pooling
        assert params is not None
        if self.pooler.task is PoolingTask.CLASSIFY:
            assert self._score is not None
            weight = self._score.weight
            logits = self._score(pooled.to(weight.dtype).reshape(1, -1)).float()[0]
            if params.activation is False:
                return logits
            if self.pooler.activation is Activation.SIGMOID:
                return torch.sigmoid(logits)
            return torch.softmax(logits, dim=-1)
        if params.dimensions is not None:
            pooled = pooled[..., :params.dimensions]
        if params.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=-1)
        return pooled
