"""Helpers shared by the scheduler and KV-cache tests: a small scheduler, requests, a
fake step (samples last token + 1), and block hashes."""

from __future__ import annotations

from services.common.sampling import SamplingParams
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.scheduler.scheduler import Scheduler

VOCAB = 1000


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
    )


def make_request(
    rid: str, prompt_len: int = 4, max_tokens: int | None = 8, **sampling: object
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        eos_token_ids=(0,),
    )


def fake_execute(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: (r.token_ids[-1] + 1) % VOCAB for r in out.requests if r.sample}


def step(s: Scheduler, sampled: dict[str, int] | None = None) -> tuple[SchedulerOutput,
                                                                        list[RequestUpdate]]:
    out = s.schedule()
    result = RunnerOutput(sampled if sampled is not None else fake_execute(out))
    return out, s.update_from_output(out, result)


def run_to_completion(s: Scheduler, max_steps: int = 1000) -> dict[str, list[RequestUpdate]]:
    updates: dict[str, list[RequestUpdate]] = {}
    for _ in range(max_steps):
        if not s.has_work():
            return updates
        _, ups = step(s)
        for u in ups:
            updates.setdefault(u.request_id, []).append(u)
        s.kv_cache.check_integrity()
    raise AssertionError("scheduler did not finish")


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def req(rid: str, prompt: list[int], max_tokens: int = 4, salt: str = "") -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   eos_token_ids=(0,), cache_salt=salt)


def compute(kv: KVCacheManager, r: Request) -> None:
    """Pretend the whole request ran: hold blocks for it and cache its full blocks."""
    assert kv.allocate_slots(r.request_id, r.num_tokens, kv.find_cached_prefix(r))
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
