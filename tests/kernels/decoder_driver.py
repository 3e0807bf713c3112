"""Drives the C++ decode op (`decode_model`) and the Python layers it replaces side by
side: which steps went through the op, and the logits or tokens of a few decode steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from corestream_kernels.decoder_layers import DecodeModel

from services.common.sampling import SamplingParams
from services.engine.models.llama import LlamaModel
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.runner_driver import all_logits

GREEDY = SamplingParams(temperature=0.0)
DECODE_MODEL = LlamaModel.decode_op


class DecodeCalls:
    """Counts the steps that went through the C++ op, so that no comparison below can
    pass by running the Python layers twice."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
        self.count = 0
        calls = self

        class Counted:
            def __init__(self, bound: DecodeModel) -> None:
                self.bound = bound
                self.has_head = bound.has_head

            def __call__(self, *args: Any) -> list[torch.Tensor]:
                calls.count += 1
                return self.bound(*args)

            def greedy(self, *args: Any) -> list[int]:
                calls.count += 1
                return self.bound.greedy(*args)

        def wrapped(model: LlamaModel, head: Any) -> Counted | None:
            bound = DECODE_MODEL(model, head) if enabled else None
            return None if bound is None else Counted(bound)

        monkeypatch.setattr(LlamaModel, "decode_op", wrapped)


def decode_logits(runner: ModelRunner, prompts: dict[str, list[int]], steps: int,
                  tag: str) -> list[torch.Tensor]:
    """Logits of a prefill, then of `steps` greedy decode steps of every prompt at once."""
    per_request = runner.model_info.max_model_len // runner.block_size
    blocks = {rid: list(range(i * per_request, (i + 1) * per_request))
              for i, rid in enumerate(prompts)}
    known = {rid: list(p) for rid, p in prompts.items()}

    def request(rid: str, start: int) -> ScheduledRequest:
        end = len(known[rid])
        return ScheduledRequest(f"{tag}{rid}", known[rid][start:], start,
                                blocks[rid][: -(-end // runner.block_size)], True, GREEDY,
                                prompts[rid], known[rid][len(prompts[rid]):])

    history = []
    scheduled = [request(rid, 0) for rid in prompts]
    for _ in range(steps + 1):
        logits = all_logits(runner, scheduled)
        history.append(logits)
        # Each request's last row predicts its next token.
        ends = torch.tensor([len(r.token_ids) for r in scheduled]).cumsum(0) - 1
        for r, token in zip(scheduled, logits[ends].argmax(-1).tolist(), strict=True):
            known[r.request_id.removeprefix(tag)].append(token)
        scheduled = [request(rid, len(known[rid]) - 1) for rid in prompts]
    return history



def greedy_decode(runner: ModelRunner, prompts: dict[str, list[int]], steps: int,
                  tag: str) -> dict[str, list[int]]:
    """The tokens of a prefill and `steps` decode steps of every prompt at once, each
    step through runner.execute as the scheduler hands it over."""
    per_request = runner.model_info.max_model_len // runner.block_size
    blocks = {rid: list(range(i * per_request, (i + 1) * per_request))
              for i, rid in enumerate(prompts)}
    known = {rid: list(p) for rid, p in prompts.items()}
    start = dict.fromkeys(prompts, 0)
    for _ in range(steps + 1):
        requests = [
            ScheduledRequest(f"{tag}{rid}", known[rid][start[rid]:], start[rid],
                             blocks[rid][: -(-len(known[rid]) // runner.block_size)], True,
                             GREEDY, prompts[rid], known[rid][len(prompts[rid]):])
            for rid in prompts]
        sampled = runner.execute(SchedulerOutput(requests)).sampled
        for rid in prompts:
            start[rid] = len(known[rid])
            known[rid].append(sampled[f"{tag}{rid}"])
    return {rid: k[len(prompts[rid]):] for rid, k in known.items()}
