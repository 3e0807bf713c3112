"""Our prefix-cache events as vLLM's engines put them on the wire, so that decoders
written for vLLM read them unchanged.

A message is three frames: the topic, the batch's sequence number (8 bytes, big
endian, from 0, one per batch) and a msgpack payload

    [timestamp, [event, ...], data_parallel_rank]

Events come in one of two layouts (`--kv-events-format`):

- "vllm", what vLLM 0.32 sends (msgspec structs, tagged, not array-like): maps
  {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
  "token_ids": [...], "block_size": N, "lora_id": nil, "medium": "GPU",
  "lora_name": nil}, {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"},
  {"type": "AllBlocksCleared"}; hashes are our 32-byte sha256 block hashes as msgpack
  bin (vLLM's are bytes too with its default sha256 hashing).
- "array", the layout of earlier vLLM releases that llm-d's KV-cache indexer
  documents and decodes: ["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium], ["BlockRemoved", block_hashes, medium],
  ["AllBlocksCleared"]; hashes are unsigned 64-bit integers there (its decoder reads
  uint64), so ours are folded to their first 8 bytes, big endian.

A run of stored blocks that chain (each one's parent the one before) is one
BlockStored, as vLLM reports a request's new blocks together; its token_ids are the
run's tokens, block_size per block. medium is "GPU" as vLLM's engines (its CPU
backend included) name their own KV cache, as opposed to an offloading tier;
corestream has no LoRA, so lora_id and lora_name are nil.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from services.common.block_hash import BlockHash
from services.common.kv_runs import RemovedRun, Run, RunBuilder, StoredRun
from services.engine.scheduler.kv_events import BlockRemoved, BlockStored, KvEvent

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last message: this sequence number, then an empty payload."""


def merge(events: Iterable[KvEvent]) -> list[Run]:
    """The events in order, chained stores and consecutive removals merged."""
    runs = RunBuilder()
    for e in events:
        if isinstance(e, BlockStored):
            runs.stored(e.seq, e.block_hash, e.parent_hash, e.token_ids)
        elif isinstance(e, BlockRemoved):
            runs.removed(e.seq, e.block_hash)
        else:
            runs.cleared(e.seq)
    return runs.runs


def fold_hash(block_hash: BlockHash) -> int:
    """A block hash as the unsigned 64-bit integer of the "array" layout."""
    return int.from_bytes(block_hash[:8], "big")


def _as_map(run: Run, block_size: int) -> dict[str, Any]:
    if isinstance(run, StoredRun):
        return {"type": "BlockStored", "block_hashes": run.hashes,
                "parent_block_hash": run.parent, "token_ids": run.token_ids,
                "block_size": block_size, "lora_id": None, "medium": MEDIUM,
                "lora_name": None}
    if isinstance(run, RemovedRun):
        return {"type": "BlockRemoved", "block_hashes": run.hashes, "medium": MEDIUM}
    return {"type": "AllBlocksCleared"}


def _as_array(run: Run, block_size: int) -> list[Any]:
    if isinstance(run, StoredRun):
        parent = fold_hash(run.parent) if run.parent is not None else None
        return ["BlockStored", [fold_hash(h) for h in run.hashes], parent, run.token_ids,
                block_size, None, MEDIUM]
    if isinstance(run, RemovedRun):
        return ["BlockRemoved", [fold_hash(h) for h in run.hashes], MEDIUM]
    return ["AllBlocksCleared"]


_LAYOUTS: dict[str, Callable[[Run, int], Any]] = {"vllm": _as_map, "array": _as_array}


def encode_batch(layout: str, timestamp: float, events: Iterable[KvEvent], block_size: int,
                 rank: int) -> bytes:
    """One batch's payload frame."""
    encode = _LAYOUTS[layout]
    return msgpack.packb([timestamp, [encode(r, block_size) for r in merge(events)], rank],
                         use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
