"""A step's batch, flattened on the host: what the model runner feeds the model.

`flatten_batch` turns the scheduler's requests into one batch of tokens, positions,
cache slots and block tables (`StepArrays`, the same on every tensor-parallel rank),
plus the rows the runner reads back: each sampled request's last token, and the
prompt positions whose logprobs are asked for. `greedy_decode_rows` is the greedy
fast path's form of a decode step: the same numbers as plain lists, for the C++
decode op. Numpy only; the runner moves the arrays to the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.sampler import plain_greedy


def cache_slot(block_ids: Sequence[int], position: int, block_size: int) -> int:
    """The KV-cache slot of the token at `position` of a sequence with these blocks."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclasses.dataclass(frozen=True, slots=True)
class StepArrays:
    """A step's flattened batch on the host: all that a forward reads, on any rank."""

    input_ids: np.ndarray
    """[T] int64"""
    positions: np.ndarray
    """[T] int64"""
    slot_mapping: np.ndarray
    """[T] int64"""
    block_tables: np.ndarray
    """[B, max_blocks] int32"""
    seq_lens: np.ndarray
    """[B] int32"""
    query_start_loc: np.ndarray
    """[B + 1] int32"""

    def as_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclasses.dataclass(slots=True)
class PromptRows:
    """The batch rows whose logprobs of the next prompt token are asked for."""

    rows: list[int] = dataclasses.field(default_factory=list)
    next_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_top: list[int] = dataclasses.field(default_factory=list)
    spans: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """(request id, number of rows), in row order."""

    def add(self, r: ScheduledRequest, first_row: int) -> None:
        assert r.prompt_logprobs is not None
        # Position p predicts prompt token p + 1; the prompt's last position predicts
        # the first sampled token, reported as a generated logprob instead.
        stop = min(r.start_pos + len(r.token_ids), len(r.prompt_token_ids) - 1)
        span = range(r.start_pos, stop)
        self.rows.extend(first_row + p - r.start_pos for p in span)
        self.next_token_ids.extend(r.prompt_token_ids[p + 1] for p in span)
        self.num_top.extend(r.prompt_logprobs for _ in span)
        self.spans.append((r.request_id, len(span)))


@dataclasses.dataclass(frozen=True, slots=True)
class HostBatch:
    arrays: StepArrays
    seq_lens: list[int]
    """The same numbers as `arrays.seq_lens`, for the host-side attention loop."""
    query_start_loc: list[int]
    """The same numbers as `arrays.query_start_loc`, likewise."""
    sample_rows: list[int]
    """Row in the flattened batch of each sampled request's last token."""
    sampled: list[ScheduledRequest]
    prompt: PromptRows


def flatten_batch(requests: Sequence[ScheduledRequest], block_size: int,
                  max_model_len: int) -> HostBatch:
    """Every scheduled request in one batch; raises ValueError for a request whose
    tokens do not fit max_model_len or its blocks."""
    # One Python pass over requests for the per-request values; the per-token
    # positions and cache slots are numpy arithmetic over the whole batch, since a
    # large batch has thousands of tokens and a Python expression each costs more
    # than the step's model overhead.
    num_seqs = len(requests)
    input_ids: list[int] = []
    start_pos: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    sampled: list[ScheduledRequest] = []
    single_slots: list[int] = []  # the cache slot of each one-token request
    prompt = PromptRows()
    # A request with draft tokens takes a one-token sequence per token, each with the
    # request's blocks and its own length: every token's keys and values are written
    # before any sequence attends, so each sees the tokens before it, as one causal
    # sequence would, and the step stays a decode step (the decode op's path).
    num_seqs += sum(r.num_draft_tokens for r in requests)
    # Padded with block 0: always a valid index, and masked out by seq_lens.
    tables = np.zeros((num_seqs, max(len(r.block_ids) for r in requests)), dtype=np.int32)
    i = 0
    for r in requests:
        end = r.start_pos + len(r.token_ids)
        if end > max_model_len or len(r.block_ids) * block_size < end:
            raise ValueError(
                f"request {r.request_id}: {end} tokens do not fit max_model_len "
                f"{max_model_len} or its {len(r.block_ids)} blocks"
            )
        if r.prompt_logprobs is not None:
            prompt.add(r, first_row=len(input_ids))
        if r.num_draft_tokens:
            for offset, token in enumerate(r.token_ids):
                position = r.start_pos + offset
                input_ids.append(token)
                start_pos.append(position)
                query_start_loc.append(len(input_ids))
                seq_lens.append(position + 1)
                tables[i, : len(r.block_ids)] = r.block_ids
                single_slots.append(cache_slot(r.block_ids, position, block_size))
                i += 1
        else:
            input_ids.extend(r.token_ids)
            start_pos.append(r.start_pos)
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            tables[i, : len(r.block_ids)] = r.block_ids
            if len(r.token_ids) == 1:
                single_slots.append(cache_slot(r.block_ids, r.start_pos, block_size))
            i += 1
        if r.sample:
            sample_rows.append(len(input_ids) - 1)
            sampled.append(r)
    if len(single_slots) == num_seqs:
        # One token each (decode): the per-token arrays are the per-request values,
        # and the numpy below would cost more than the rest of the preparation.
        positions = np.array(start_pos, dtype=np.int64)
        slot_mapping = np.array(single_slots, dtype=np.int64)
    else:
        query_lens = np.diff(query_start_loc)
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        # A token's position: its row, shifted by where its sequence starts in the
        # batch and in the cache.
        shift = np.array(start_pos, dtype=np.int64) - query_start_loc[:-1]
        positions = np.arange(len(input_ids), dtype=np.int64) + np.repeat(shift, query_lens)
        blocks = tables[seq_of_token, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
    arrays = StepArrays(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=np.array(seq_lens, dtype=np.int32),
        query_start_loc=np.array(query_start_loc, dtype=np.int32),
    )
    return HostBatch(arrays, seq_lens, query_start_loc, sample_rows, sampled, prompt)


@dataclasses.dataclass(frozen=True, slots=True)
class GreedyDecodeRows:
    """A greedy decode step as the C++ decode op takes it: one token per sequence."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[Sequence[int]]
    """Each sequence's blocks, unpadded."""
    seq_lens: list[int]


def greedy_decode_rows(requests: Sequence[ScheduledRequest], block_size: int,
                       max_model_len: int) -> GreedyDecodeRows | None:
    """The step's rows when every request decodes one token (and its draft tokens, if
    it has any), greedy without logit processors or logprobs; None where it does not
    apply.

    A request with drafts takes a row per token, each with the request's blocks and
    its own length: the op writes every row's keys and values before any row attends,
    so each row sees the tokens before it, as in a causal forward over them."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[Sequence[int]] = []
    seq_lens: list[int] = []
    for r in requests:
        if (len(r.token_ids) != 1 + r.num_draft_tokens or not r.sample
                or r.sampling.logprobs is not None or not plain_greedy(r)):
            return None
        blocks = r.block_ids
        end = r.start_pos + len(r.token_ids)
        if end > min(len(blocks) * block_size, max_model_len):
            return None  # flatten_batch names the fault
        for i, token in enumerate(r.token_ids):
            position = r.start_pos + i
            input_ids.append(token)
            positions.append(position)
            slots.append(cache_slot(blocks, position, block_size))
            tables.append(blocks)
            seq_lens.append(position + 1)
    return GreedyDecodeRows(input_ids, positions, slots, tables, seq_lens)
