"""Log-probabilities of chosen tokens, from the model's raw logits.

As in vLLM's default, they describe the model's own distribution: log_softmax of
the float32 logits before logit bias, penalties, temperature and truncation, so a
client sees the same numbers whatever it samples with. Only requests that ask
pay for them: the runner calls in here for their rows alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.engine.scheduler.output import PositionLogprobs

# Prompt rows whose full-vocabulary logits exist at once: bounds the memory of a
# long prefill chunk (rows x vocab x 4 bytes) to a few hundred MB for large vocabs.
PROMPT_ROWS_PER_SLICE = 512


def position_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[PositionLogprobs]:
    """Row i's logprob and rank of `token_ids[i]` and its `num_top[i]` most likely tokens.

    logits: `[N, vocab]` raw; token_ids: `[N]` int64 on the same device.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    # Ties share the best rank: the count of strictly more likely tokens, plus one.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    rows = zip(
        token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
        top_ids.tolist(), top_values.tolist(), num_top, strict=True,
    )
    return [
        PositionLogprobs(token, logprob, rank, tuple(zip(ids[:n], values[:n], strict=True)))
        for token, logprob, rank, ids, values, n in rows
    ]


def prompt_logprobs(
    rows: list[int],
    next_token_ids: list[int],
    num_top: list[int],
    logits_at: Callable[[list[int]], torch.Tensor],
) -> list[PositionLogprobs]:
    """Logprobs of each prompt row's next prompt token, a slice of rows at a time.

    `logits_at(rows)`: the step's logits at those rows of its flattened batch.
    """
    out: list[PositionLogprobs] = []
    for start in range(0, len(rows), PROMPT_ROWS_PER_SLICE):
        end = start + PROMPT_ROWS_PER_SLICE
        logits = logits_at(rows[start:end])
        targets = torch.tensor(next_token_ids[start:end], device=logits.device)
        out += position_logprobs(logits, targets, num_top[start:end])
    return out
