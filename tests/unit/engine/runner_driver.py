"""Drives a ModelRunner the way the scheduler would, with a trivial block allocation."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.sampling import SamplingParams
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


def make_runner(folder: Path, dtype: str = "float32", max_model_len: int = 128,
                device: str = "cpu", kv_cache_dtype: str = "auto") -> ModelRunner:
    config = RunnerConfig(
        model=str(folder), dtype=dtype, device=device, block_size=4, kv_cache_memory=4 << 20,
        max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
    )
    return ModelRunner(config)


def random_prompts(lengths: dict[str, int], vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)
    return {rid: torch.randint(3, vocab, (n,), generator=gen).tolist()
            for rid, n in lengths.items()}


def all_logits(runner: ModelRunner, requests: list[ScheduledRequest]) -> torch.Tensor:
    """float32 logits of every token of one step `[T, vocab]`, not only the sampled ones."""
    with torch.inference_mode():
        batch = runner._prepare(requests)
        hidden = runner.model(batch.input_ids, batch.positions, batch.meta, runner.kv_caches)
        return runner.model.compute_logits(hidden)


def generate(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    num_tokens: int,
    first_chunk: dict[str, int] | None = None,
    sampling: SamplingParams = GREEDY,
) -> dict[str, list[int]]:
    """`num_tokens` new tokens per prompt, every request advancing in the same steps.

    `first_chunk[rid] = n` feeds only the first n prompt tokens in the first step
    (a chunked prefill); the rest of the prompt follows in the next step.
    """
    first_chunk = first_chunk or {}
    per_request = runner.model_info.max_model_len // runner.block_size
    assert per_request * len(prompts) <= runner.num_blocks
    blocks = {rid: list(range(i * per_request, (i + 1) * per_request))
              for i, rid in enumerate(prompts)}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    computed = dict.fromkeys(prompts, 0)
    while any(len(out) < num_tokens for out in outputs.values()):
        scheduled = []
        for rid, prompt in prompts.items():
            if len(outputs[rid]) >= num_tokens:
                continue
            known = prompt + outputs[rid]
            start = computed[rid]
            end = first_chunk[rid] if start == 0 and rid in first_chunk else len(known)
            num_blocks = -(-end // runner.block_size)
            scheduled.append(ScheduledRequest(
                request_id=rid,
                token_ids=known[start:end],
                start_pos=start,
                block_ids=blocks[rid][:num_blocks],
                sample=end == len(known),
                sampling=sampling,
                prompt_token_ids=prompt,
                output_token_ids=list(outputs[rid]),
            ))
            computed[rid] = end
        for rid, token in runner.execute(SchedulerOutput(scheduled)).sampled.items():
            outputs[rid].append(token)
    return outputs


def teacher_forced(runner: ModelRunner, prompts: dict[str, list[int]],
                   teacher: dict[str, list[int]]) -> dict[str, list[int]]:
    """Our greedy pick at each position of prompt + `teacher` continuation: the prompt's
    prefill predicts teacher[0], then decode step k (fed teacher[k - 1]) predicts
    teacher[k], every request advancing in the same steps (so a decode step multiplies
    one row per request)."""
    blocks: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        first = sum(map(len, blocks.values()))
        needed = -(-(len(prompt) + len(teacher[rid])) // runner.block_size)
        blocks[rid] = list(range(first, first + needed))
    assert sum(map(len, blocks.values())) <= runner.num_blocks
    picks: dict[str, list[int]] = {rid: [] for rid in prompts}
    for step in range(max(map(len, teacher.values()))):
        scheduled = []
        for rid, prompt in prompts.items():
            if step >= len(teacher[rid]):
                continue
            known = prompt + teacher[rid][:step]
            start = 0 if step == 0 else len(known) - 1
            scheduled.append(ScheduledRequest(
                request_id=rid, token_ids=known[start:], start_pos=start,
                block_ids=blocks[rid][:-(-len(known) // runner.block_size)], sample=True,
                sampling=GREEDY, prompt_token_ids=prompt,
                output_token_ids=teacher[rid][:step]))
        for rid, token in runner.execute(SchedulerOutput(scheduled)).sampled.items():
            picks[rid].append(token)
    return picks
