"""Sequences: a batch of greedy sequences driven through a model runner or executor
step by step, as the scheduler would, with a trivial block allocation; shared by the
benchmarks that time steps in process."""

from __future__ import annotations

from typing import Any

from services.common.sampling import SamplingParams
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0)


class Sequences:
    """`batch` sequences with the given prompts, each with its own KV blocks; `prefill`
    then `decode` steps drive them through an executor as the scheduler would."""

    def __init__(self, executor: Any, prompts: list[list[int]], capacity: int, tag: str):
        self.executor = executor
        self.prompts = {f"{tag}{i}": p for i, p in enumerate(prompts)}
        per_seq = -(-capacity // executor.block_size)
        assert per_seq * len(prompts) <= executor.num_blocks, "raise kv_cache_memory"
        self.blocks = {rid: list(range(i * per_seq, (i + 1) * per_seq))
                       for i, rid in enumerate(self.prompts)}
        self.outputs: dict[str, list[int]] = {rid: [] for rid in self.prompts}

    def _request(self, rid: str, tokens: list[int], start: int) -> ScheduledRequest:
        num_blocks = -(-(start + len(tokens)) // self.executor.block_size)
        return ScheduledRequest(rid, tokens, start, self.blocks[rid][:num_blocks], True, GREEDY,
                                self.prompts[rid], list(self.outputs[rid]))

    def _run(self, requests: list[ScheduledRequest]) -> None:
        for rid, token in self.executor.execute(SchedulerOutput(requests)).sampled.items():
            self.outputs[rid].append(token)

    def prefill(self) -> None:
        self._run([self._request(rid, p, 0) for rid, p in self.prompts.items()])

    def decode(self) -> None:
        self._run([self._request(rid, [out[-1]], len(self.prompts[rid]) + len(out) - 1)
                   for rid, out in self.outputs.items()])

    def finish(self) -> list[list[int]]:
        self.executor.execute(SchedulerOutput([], finished_request_ids=frozenset(self.prompts)))
        return list(self.outputs.values())
