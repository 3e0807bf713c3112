"""Turning each sampled request's logits into its next token.

Order, per row: logit bias, repetition penalty (prompt + output, HF's rule),
presence and frequency penalties (output only), min_tokens masking of EOS and stop
ids, then the output constraint's token mask, then temperature, min_p, top_k and
top_p, then a draw. The mask comes after the processors, so it always wins: a
constrained row whose processors left no allowed token (min_tokens against a
grammar that must end) falls back to the mask alone. Greedy rows take the argmax
after the logit processors; if every row is greedy and none has a processor or a
mask, the whole batch is one argmax.

Draws use the exponential race (argmax of p / q with q ~ Exp(1)), which samples
from p exactly without `multinomial`'s host sync. A request with a seed draws its q
from a generator seeded by (seed, tokens generated so far): its tokens then depend
only on its own logits, whatever shares the batch, and a request recomputed after
preemption repeats them. Requests without a seed share the engine's generator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common.sampling import SamplingParams
from services.engine.scheduler.output import ScheduledRequest

_SEED_MASK = (1 << 63) - 1


def has_logit_processors(request: ScheduledRequest) -> bool:
    s = request.sampling
    return bool(
        s.logit_bias
        or s.repetition_penalty != 1.0
        or s.presence_penalty
        or s.frequency_penalty
        or len(request.output_token_ids) < s.min_tokens
    )


def plain_greedy(request: ScheduledRequest) -> bool:
    """Greedy without logit processors: its token is its logits' argmax."""
    return request.sampling.greedy and not has_logit_processors(request)


def step_seed(seed: int, num_output_tokens: int) -> int:
    # Tuple hashing of ints is stable across processes (only str/bytes are salted).
    return hash((seed, num_output_tokens)) & _SEED_MASK


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest],
                 mask: TokenMask | None = None) -> torch.Tensor:
        """Next token ids `[N]` (int64, on device) for float32 logits `[N, vocab]`;
        `mask` restricts the rows of constrained requests."""
        assert logits.shape[0] == len(requests), (logits.shape, len(requests))
        # One lazy pass decides the common case, an all-greedy batch without processors.
        if mask is None and all(plain_greedy(r) for r in requests):
            return logits.argmax(dim=-1)
        params = [r.sampling for r in requests]
        raw = logits
        if mask is not None or any(has_logit_processors(r) for r in requests):
            logits = logits.clone()
            _apply_logit_processors(logits, requests)
        if mask is not None:
            _apply_mask(logits, raw, mask, requests)
        greedy_tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return greedy_tokens
        rows = torch.tensor(sampled_rows, device=logits.device)
        sampled = self._sample(logits[rows], [requests[i] for i in sampled_rows])
        return greedy_tokens.index_copy(0, rows, sampled)

    def _sample(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> torch.Tensor:
        params = [r.sampling for r in requests]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        logits = _filter(logits, params)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        if any(p.seed is None for p in params):
            q.exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            seed = request.sampling.seed
            if seed is not None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(step_seed(seed, len(request.output_token_ids)))
                q[i].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)


@dataclass(frozen=True, slots=True)
class TokenMask:
    """Allowed tokens of some rows: `bitmask[i]` (a host int32 numpy array of packed
    words, bit t % 32 of word t // 32) restricts row `rows[i]` of the logits."""

    rows: list[int]
    bitmask: np.ndarray


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """The packed bitmask `[R, W]` unpacked to booleans `[R, vocab]` on `device`.

    On the host numpy unpacks (one C loop, no OpenMP fork: torch's int32 bit ops are
    slow there and contend with the model's threads); a GPU gets the 32x smaller packed
    words and unpacks them itself."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    packed = torch.from_numpy(bitmask).pin_memory().to(device, non_blocking=True)
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab].bool()


def _apply_mask(logits: torch.Tensor, raw: torch.Tensor, mask: TokenMask,
                requests: Sequence[ScheduledRequest]) -> None:
    """Disallowed tokens to -inf, in place. Only min_tokens can leave a row no allowed
    token (it bans EOS, which a complete grammar needs): such rows take the raw logits
    under the mask instead, since the grammar wins. No host sync."""
    banned = ~allowed_tokens(mask.bitmask, logits.shape[1], logits.device)
    if mask.rows == list(range(logits.shape[0])):
        logits.masked_fill_(banned, float("-inf"))
    else:
        rows = torch.tensor(mask.rows, device=logits.device)
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(
            banned, float("-inf")))
    for i, row in enumerate(mask.rows):
        r = requests[row]
        if len(r.output_token_ids) < r.sampling.min_tokens:
            fallback = raw[row].masked_fill(banned[i], float("-inf"))
            empty = logits[row].amax() == float("-inf")
            logits[row] = torch.where(empty, fallback, logits[row])


def _apply_logit_processors(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> None:
    """Bias, penalties and min_tokens masking, in place; index lists are built on the host."""
    vocab = logits.shape[1]
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    repeat: tuple[list[int], list[int], list[float]] = ([], [], [])
    counted: tuple[list[int], list[int], list[float]] = ([], [], [])
    banned: tuple[list[int], list[int]] = ([], [])
    for row, request in enumerate(requests):
        s = request.sampling
        for token, value in s.logit_bias:
            if 0 <= token < vocab:
                _append(bias, row, token, value)
        if s.repetition_penalty != 1.0:
            for token in set(request.prompt_token_ids) | set(request.output_token_ids):
                _append(repeat, row, token, s.repetition_penalty)
        if s.presence_penalty or s.frequency_penalty:
            for token, count in Counter(request.output_token_ids).items():
                _append(counted, row, token, s.presence_penalty + s.frequency_penalty * count)
        if len(request.output_token_ids) < s.min_tokens:
            for token in {*request.eos_token_ids, *s.stop_token_ids}:
                if 0 <= token < vocab:
                    banned[0].append(row)
                    banned[1].append(token)

    device = logits.device
    if bias[0]:
        rows, cols = _index(bias, device)
        logits.index_put_((rows, cols), torch.tensor(bias[2], device=device), accumulate=True)
    if repeat[0]:
        rows, cols = _index(repeat, device)
        penalty = torch.tensor(repeat[2], device=device)
        seen = logits[rows, cols]
        logits[rows, cols] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if counted[0]:
        rows, cols = _index(counted, device)
        logits[rows, cols] -= torch.tensor(counted[2], device=device)
    if banned[0]:
        logits[_index(banned, device)] = float("-inf")


def _append(
    lists: tuple[list[int], list[int], list[float]], row: int, token: int, value: float
) -> None:
    lists[0].append(row)
    lists[1].append(token)
    lists[2].append(value)


def _index(
    lists: tuple[list[int], list[int]] | tuple[list[int], list[int], list[float]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(lists[0], device=device), torch.tensor(lists[1], device=device))


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set to -inf what min_p, top_k and top_p exclude (the top token always survives)."""
    device = logits.device
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    use_top_k = any(p.top_k > 0 for p in params)
    if not use_top_k and all(p.top_p >= 1.0 for p in params):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    excluded = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        excluded |= torch.arange(vocab, device=device)[None, :] >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(excluded, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p.
    excluded |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    excluded[:, 0] = False
    unsorted = torch.zeros_like(excluded).scatter(1, order, excluded)
    return logits.masked_fill(unsorted, float("-inf"))
