"""Drives a ModelRunner the way the scheduler would, with a trivial block allocation."""

from __future__ import annotations

from services.common.sampling import SamplingParams
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from services.engine.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


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
        for rid, token in runner.execute(SchedulerOutput(scheduled)).items():
            outputs[rid].append(token)
    return outputs
