"""Prefix-cache events grouped as vLLM reports them: a run of stored blocks that chain
(each one's parent the block before it) is one event with every block's hash and
tokens, and consecutive removals are one event. Two edges publish vLLM's format: the
engine's ZeroMQ publisher (from its own events) and the frontend's vLLM gRPC
SubscribeKvEvents (from the engines' Session events); both group through `RunBuilder`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.block_hash import NO_PARENT, BlockHash


@dataclass
class StoredRun:
    first_seq: int
    hashes: list[BlockHash]
    parent: BlockHash | None
    """The first block's parent; None for a request's first block."""
    token_ids: list[int] = field(default_factory=list)


@dataclass
class RemovedRun:
    first_seq: int
    hashes: list[BlockHash]


@dataclass
class Cleared:
    seq: int


Run = StoredRun | RemovedRun | Cleared


class RunBuilder:
    """Feed the events in their order; `runs` holds the groups so far."""

    def __init__(self) -> None:
        self.runs: list[Run] = []

    def stored(self, seq: int, block_hash: BlockHash, parent_hash: BlockHash,
               token_ids: Sequence[int]) -> None:
        last = self.runs[-1] if self.runs else None
        if isinstance(last, StoredRun) and parent_hash == last.hashes[-1]:
            last.hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            parent = parent_hash if parent_hash != NO_PARENT else None
            self.runs.append(StoredRun(seq, [block_hash], parent, list(token_ids)))

    def removed(self, seq: int, block_hash: BlockHash) -> None:
        last = self.runs[-1] if self.runs else None
        if isinstance(last, RemovedRun):
            last.hashes.append(block_hash)
        else:
            self.runs.append(RemovedRun(seq, [block_hash]))

    def cleared(self, seq: int) -> None:
        self.runs.append(Cleared(seq))
