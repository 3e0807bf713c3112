"""The vLLM wire format, decoded with plain msgpack against the documented layout."""

from __future__ import annotations

import msgpack
import pytest

from services.common.block_hash import NO_PARENT, hash_block
from services.engine.kv_publisher.config import KvEventsConfig, binds, endpoint_for_rank
from services.engine.kv_publisher.wire import encode_batch, fold_hash, merge
from services.engine.scheduler.kv_events import BlockRemoved, BlockStored, CacheCleared

A = hash_block(None, [1, 2])
B = hash_block(A, [3, 4])
C = hash_block(B, [5, 6])
X = hash_block(None, [9, 9])


def _events() -> list:
    return [BlockStored(1, A, NO_PARENT, (1, 2)), BlockStored(2, B, A, (3, 4)),
            BlockStored(3, C, B, (5, 6)),
            BlockStored(4, X, NO_PARENT, (9, 9)),  # a new chain: a new event
            BlockRemoved(5, A), BlockRemoved(6, X),
            CacheCleared(7),
            BlockStored(8, A, NO_PARENT, (1, 2))]


def test_vllm_layout_is_vllm_0_32s_tagged_maps() -> None:
    ts, events, rank = msgpack.unpackb(encode_batch("vllm", 12.5, _events(), 2, 3))
    assert (ts, rank) == (12.5, 3)
    stored = {"lora_id": None, "medium": "GPU", "lora_name": None, "block_size": 2,
              "type": "BlockStored"}
    assert events == [
        {**stored, "block_hashes": [A, B, C], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4, 5, 6]},
        {**stored, "block_hashes": [X], "parent_block_hash": None, "token_ids": [9, 9]},
        {"type": "BlockRemoved", "block_hashes": [A, X], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {**stored, "block_hashes": [A], "parent_block_hash": None, "token_ids": [1, 2]},
    ]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in events[0]["block_hashes"])


def test_array_layout_is_the_tagged_arrays_llm_d_decodes() -> None:
    ts, events, rank = msgpack.unpackb(encode_batch("array", 1.0, _events()[1:5], 2, 0))
    assert events == [
        ["BlockStored", [fold_hash(B), fold_hash(C)], fold_hash(A), [3, 4, 5, 6], 2, None,
         "GPU"],
        ["BlockStored", [fold_hash(X)], None, [9, 9], 2, None, "GPU"],
        ["BlockRemoved", [fold_hash(A)], "GPU"],
    ]
    assert fold_hash(A) == int.from_bytes(A[:8], "big") < 1 << 64


def test_a_store_that_does_not_continue_the_run_starts_a_new_event() -> None:
    # B's parent is A, but a removal came between them: two events, B names A.
    runs = merge([BlockStored(1, A, NO_PARENT, (1, 2)), BlockRemoved(2, X),
                  BlockStored(3, B, A, (3, 4))])
    assert [type(r).__name__ for r in runs] == ["StoredRun", "RemovedRun", "StoredRun"]
    assert runs[2].parent == A  # type: ignore[union-attr]


def test_endpoints_follow_vllms_rank_offsets_and_bind_rules() -> None:
    assert endpoint_for_rank("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert endpoint_for_rank("tcp://10.0.0.5:5557", 2) == "tcp://10.0.0.5:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://epp.example:5557")


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_events_endpoint": "http://x:1"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://x"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://x:70000"}, "kv_events_endpoint"),
    ({"kv_events_replay_endpoint": "tcp://*:5558"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:1", "kv_events_format": "json"}, "kv_events_format"),
    ({"kv_events_buffer_steps": 0}, "kv_events_buffer_steps"),
])
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KvEventsConfig(**kwargs)
