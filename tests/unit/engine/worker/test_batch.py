"""The runner's flattened batch: positions and cache slots of every token, whether the
step is decode-only (one token per request, its own fast path) or mixed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.engine.scheduler.output import ScheduledRequest
from tests.unit.engine.fixed_logits_checkpoint import VOCAB, write_checkpoint
from tests.unit.engine.runner_driver import GREEDY, make_runner

BLOCK = 4  # runner_driver's block size


def scheduled(rid: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, blocks, True, GREEDY, [1] * start, [])


def expected(requests: list[ScheduledRequest]) -> tuple[list[int], list[int]]:
    """Every token's position and slot, one token at a time."""
    positions, slots = [], []
    for r in requests:
        for offset in range(len(r.token_ids)):
            pos = r.start_pos + offset
            positions.append(pos)
            slots.append(r.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK)
    return positions, slots


@pytest.mark.parametrize("chunks", [
    # decode only, at and across block boundaries, with scattered block ids
    [([5], 0, [7]), ([6], 3, [2]), ([7], 4, [9, 3]), ([8], 11, [4, 8, 1])],
    # a prefill chunk, a decode, a chunk that continues a prompt
    [([5, 6, 7, 8, 9], 0, [3, 6]), ([6], 7, [1, 5]), ([3, 4, 5], 6, [0, 2, 8])],
    # one request, one token
    [([9], 2, [5])],
])
def test_positions_and_slots(tmp_path: Path,
                             chunks: list[tuple[list[int], int, list[int]]]) -> None:
    runner = make_runner(write_checkpoint(tmp_path / "fixed", np.zeros(VOCAB)))
    requests = [scheduled(f"r{i}", tokens, start, blocks)
                for i, (tokens, start, blocks) in enumerate(chunks)]
    arrays = runner._prepare(requests).arrays
    positions, slots = expected(requests)
    assert arrays.positions.tolist() == positions
    assert arrays.slot_mapping.tolist() == slots
    assert arrays.positions.dtype == arrays.slot_mapping.dtype == np.int64
    assert arrays.input_ids.tolist() == [t for r in requests for t in r.token_ids]
    assert arrays.seq_lens.tolist() == [r.start_pos + len(r.token_ids) for r in requests]


def test_greedy_rows_give_each_draft_position_a_row_of_its_own() -> None:
    from dataclasses import replace

    from services.engine.worker.batch import greedy_decode_rows

    plain = scheduled("a", [9], 5, [3, 6])
    verify = replace(scheduled("b", [4, 7, 8], 6, [1, 2, 5]), num_draft_tokens=2)
    rows = greedy_decode_rows([plain, verify], BLOCK, 64)
    assert rows is not None
    assert rows.input_ids == [9, 4, 7, 8]
    assert rows.positions == [5, 6, 7, 8]
    assert rows.seq_lens == [6, 7, 8, 9]
    assert rows.block_tables == [[3, 6], [1, 2, 5], [1, 2, 5], [1, 2, 5]]
    assert rows.slot_mapping == expected([plain, verify])[1]
    # A chunk of several tokens that are not drafts (a prefill) has no such rows.
    assert greedy_decode_rows([scheduled("c", [4, 7, 8], 6, [1, 2, 5])], BLOCK, 64) is None


def test_a_request_with_drafts_is_flattened_as_one_token_sequences(tmp_path: Path) -> None:
    from dataclasses import replace

    runner = make_runner(write_checkpoint(tmp_path / "fixed", np.zeros(VOCAB)))
    prefill = scheduled("p", [5, 6, 7], 0, [4])
    verify = replace(scheduled("v", [4, 7, 8], 6, [1, 2, 5]), num_draft_tokens=2)
    host = runner._prepare([prefill, verify]).host
    assert host.arrays.input_ids.tolist() == [5, 6, 7, 4, 7, 8]
    assert host.arrays.positions.tolist() == expected([prefill, verify])[0]
    assert host.arrays.slot_mapping.tolist() == expected([prefill, verify])[1]
    assert host.seq_lens == [3, 7, 8, 9]
    assert host.query_start_loc == [0, 3, 4, 5, 6]
    assert host.arrays.block_tables[1:, :3].tolist() == [[1, 2, 5]] * 3
    assert host.sample_rows == [2, 5]  # the last row of each, as without drafts
