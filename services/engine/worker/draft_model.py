"""The draft model of speculative decoding: a smaller checkpoint of the target's
vocabulary that proposes each request's next tokens greedily, in the model runner.

It keeps a KV cache of its own, indexed by the target's block tables (the same block ids
and block size, so a request's blocks hold its keys and values in both caches), and
catches up lazily: when the scheduler asks for proposals after a step
(`ScheduledRequest.num_lookahead`), the draft runs over the request's tokens it has not
seen yet (its whole context the first time, after that the tokens accepted since, and the
step's new token), whose last position gives the first proposal; each further proposal
is one more greedy decode step. The positions of its proposals are scratch: the next
step's pass over the accepted tokens writes them again. Requests the scheduler never
asks about cost the draft nothing.

Greedy proposals are one-hot: the runner's verification (sample each position as the
target would, keep drafts while they agree) then keeps the target's distribution for
any sampling settings.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from services.common.model_info import ModelInfo, load_model_info
from services.common.sampling import SamplingParams
from services.common.tiny_checkpoint import resolve_model
from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.loader import load_model
from services.engine.models.protocol import CausalLM, GreedyDecoder
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.batch import cache_slot, flatten_batch, greedy_decode_rows
from services.engine.worker.kv_cache_memory import KVCacheLayout

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)
# Unseen tokens of a request that the decode op takes as rows; more (a whole context on
# the first proposal) take the batched forward.
_DECODE_ROWS = 17


class DraftMismatch(ValueError):
    """The draft checkpoint cannot propose for this target (the message says why)."""


def check_draft(target: ModelInfo, target_path: Path, draft: ModelInfo,
                draft_path: Path) -> None:
    """DraftMismatch unless the draft shares the target's vocabulary and tokenizer and
    holds its context."""
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatch(
            f"speculative_config: the draft model {draft.name} has a vocabulary of "
            f"{draft.vocab_size} tokens, the target {target.name} {target.vocab_size}: a "
            "draft must share the target's tokenizer")
    vocab = [_tokenizer_vocab(p) for p in (target_path, draft_path)]
    if None not in vocab and vocab[0] != vocab[1]:
        differ = sorted(set(vocab[0].items()) ^ set(vocab[1].items()))  # type: ignore[union-attr]
        token = differ[0][0] if differ else "?"
        raise DraftMismatch(
            f"speculative_config: the draft model {draft.name}'s tokenizer differs from the "
            f"target {target.name}'s ({len(differ)} token/id pairs differ, e.g. {token!r}): "
            "its token ids would mean other words")
    if draft.max_model_len < target.max_model_len:
        raise DraftMismatch(
            f"speculative_config: the draft model {draft.name} holds {draft.max_model_len} "
            f"tokens of context, less than the target's max_model_len "
            f"{target.max_model_len}: lower --max-model-len")


def _tokenizer_vocab(folder: Path) -> dict[str, int] | None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def resolve_draft(path: str, target: ModelInfo) -> tuple[Path, ModelInfo]:
    """The draft checkpoint's folder and metadata, checked against the target (before
    either model loads); DraftMismatch (a ValueError) naming what is wrong."""
    try:
        folder = resolve_model(path)
        info = load_model_info(folder)
    except (OSError, ValueError) as exc:
        raise DraftMismatch(f"speculative_config: the draft model: {exc}") from None
    check_draft(target, Path(target.path), info, folder)
    return folder, info


class DraftModel:
    def __init__(self, draft: tuple[Path, ModelInfo], target: ModelInfo, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, block_size: int) -> None:
        """`draft`: resolve_draft's answer."""
        folder, info = draft
        self.info = info
        self._device = device
        self._dtype = dtype
        self._block_size = block_size
        self._max_model_len = target.max_model_len
        with torch.inference_mode():
            self.model: CausalLM = load_model(folder, dtype, device, target.max_model_len)
        config = self.model.config
        self._layout = KVCacheLayout(config.num_hidden_layers, block_size,
                                     self.model.local_kv_heads, config.head_dim,
                                     dtype.itemsize)
        self._num_blocks = num_blocks
        self.kv_caches: list[torch.Tensor] = []
        self.wake()
        self._decode = (self.model.decode_greedy if device.type == "cpu"
                        and isinstance(self.model, GreedyDecoder) else None)
        # Per request: (its attempt, how many of its tokens the draft's cache holds).
        self._seen: dict[str, tuple[int, int]] = {}
        logger.info("draft model %s: %d layers, its KV cache %d MiB (%d blocks of %d tokens)",
                    info.name, config.num_hidden_layers, self.cache_bytes >> 20, num_blocks,
                    block_size)

    @property
    def cache_bytes(self) -> int:
        return self._layout.block_bytes * self._num_blocks

    def sleep(self) -> None:
        """Free the cache (the engine sleeps); what it held is forgotten."""
        self.kv_caches = []
        self.model.model.forget_decode_op()
        self._seen.clear()

    def wake(self) -> None:
        if not self.kv_caches:
            shape = self._layout.block_shape(self._num_blocks)
            self.kv_caches = [torch.zeros(shape, dtype=self._dtype, device=self._device)
                              for _ in range(self.model.config.num_hidden_layers)]

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._seen.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests: Sequence[tuple[ScheduledRequest, Sequence[int]]],
                ) -> dict[str, list[int]]:
        """Each request's `num_lookahead` greedy continuations of its tokens, the step's
        new ones (`requests[i][1]`) included."""
        chunks: list[ScheduledRequest] = []
        for sr, new in requests:
            num_tokens = len(sr.prompt_token_ids) + len(sr.output_token_ids) + len(new)
            attempt, seen = self._seen.get(sr.request_id, (sr.attempt, 0))
            if attempt != sr.attempt:
                seen = 0  # preempted since: its blocks are others now
            chunks.append(ScheduledRequest(
                sr.request_id, _tokens(sr, new, seen, num_tokens), seen, sr.block_ids, True,
                _GREEDY, sr.prompt_token_ids, ()))
            self._seen[sr.request_id] = (sr.attempt, num_tokens)
        drafts = [[t] for t in self._catch_up(chunks)]
        steps = max(sr.num_lookahead for sr, _ in requests)
        for i in range(1, steps):
            rows = [(sr, chunk.start_pos + len(chunk.token_ids) - 1 + i, d[-1])
                    for (sr, _), chunk, d in zip(requests, chunks, drafts, strict=True)
                    if sr.num_lookahead > i]
            tokens = self._decode_step(rows)
            it = iter(tokens)
            for (sr, _), d in zip(requests, drafts, strict=True):
                if sr.num_lookahead > i:
                    d.append(next(it))
        return {sr.request_id: d[: sr.num_lookahead]
                for (sr, _), d in zip(requests, drafts, strict=True)}

    def _catch_up(self, chunks: list[ScheduledRequest]) -> list[int]:
        """Run the draft over each request's unseen tokens; its argmax after the last.

        A few unseen tokens (the usual step: the accepted drafts and the new token) go
        to the decode op as one-token rows, as a verify step's do; a whole context (the
        request's first proposal) takes the batched forward."""
        firsts: list[int | None] = [None] * len(chunks)
        few = [i for i, c in enumerate(chunks) if len(c.token_ids) <= _DECODE_ROWS]
        if self._decode is not None and few:
            as_rows = [dataclasses.replace(chunks[i],
                                           num_draft_tokens=len(chunks[i].token_ids) - 1)
                       for i in few]
            rows = greedy_decode_rows(as_rows, self._block_size, self._max_model_len)
            tokens = (self._decode(self.kv_caches, rows.input_ids, rows.positions,
                                   rows.slot_mapping, rows.block_tables, rows.seq_lens)
                      if rows is not None else None)
            if tokens is not None:
                end = 0
                for i, r in zip(few, as_rows, strict=True):
                    end += len(r.token_ids)
                    firsts[i] = tokens[end - 1]
        rest = [i for i, t in enumerate(firsts) if t is None]
        if rest:
            host = flatten_batch([chunks[i] for i in rest], self._block_size,
                                 self._max_model_len)
            hidden = self._forward(host.arrays.input_ids, host.arrays.positions,
                                   host.arrays.slot_mapping, host.arrays.block_tables,
                                   host.seq_lens, host.query_start_loc)
            rows = torch.tensor(host.sample_rows, device=hidden.device)
            found = self.model.compute_logits(hidden.index_select(0, rows)).argmax(-1)
            for i, t in zip(rest, found.tolist(), strict=True):
                firsts[i] = t
        return [t for t in firsts if t is not None]

    def _decode_step(self, rows: list[tuple[ScheduledRequest, int, int]]) -> list[int]:
        """One greedy token per row (request, position, token at that position)."""
        input_ids = [token for _, _, token in rows]
        positions = [position for _, position, _ in rows]
        slots = [cache_slot(sr.block_ids, p, self._block_size) for sr, p, _ in rows]
        tables = [sr.block_ids for sr, _, _ in rows]
        seq_lens = [p + 1 for p in positions]
        if self._decode is not None:
            tokens = self._decode(self.kv_caches, input_ids, positions, slots, tables,
                                  seq_lens)
            if tokens is not None:
                return tokens
        width = max(len(t) for t in tables)
        table_array = np.zeros((len(rows), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table_array[i, : len(t)] = t
        hidden = self._forward(np.array(input_ids, dtype=np.int64),
                               np.array(positions, dtype=np.int64),
                               np.array(slots, dtype=np.int64), table_array, seq_lens,
                               list(range(len(rows) + 1)))
        return self.model.compute_logits(hidden).argmax(-1).tolist()

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                 tables: np.ndarray, seq_lens: list[int], query_start_loc: list[int],
                 ) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            block_tables=self._to_device(tables),
            seq_lens=self._to_device(np.array(seq_lens, dtype=np.int32)),
            query_start_loc=self._to_device(np.array(query_start_loc, dtype=np.int32)),
            seq_lens_host=seq_lens,
            query_start_loc_host=query_start_loc,
        )
        return self.model(self._to_device(input_ids), self._to_device(positions), meta,
                          self.kv_caches)

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(values)
        return tensor if self._device.type == "cpu" else tensor.to(self._device)


def _tokens(sr: ScheduledRequest, new: Sequence[int], start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of the request's prompt, outputs and the step's new ones."""
    parts = (sr.prompt_token_ids, sr.output_token_ids, new)
    out: list[int] = []
    offset = 0
    for part in parts:
        lo, hi = max(start - offset, 0), min(stop - offset, len(part))
        if lo < hi:
            out.extend(part[lo:hi])
        offset += len(part)
    return out

