"""Scheduler behaviour on a tiny KV cache, driven by a fake 'model' (last token + 1)."""

from __future__ import annotations

import pytest

from services.engine.request import FinishReason, RequestStatus, RequestUpdate
from services.engine.scheduler.output import PositionLogprobs, RunnerOutput, SchedulerOutput
from services.engine.scheduler.scheduler import RequestRejected, Scheduler
from tests.unit.engine.scheduler_helpers import (
    fake_execute,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def test_single_request_prefill_then_decodes() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=4, max_tokens=3))
    out, ups = step(s)
    [sr] = out.requests
    assert list(sr.token_ids) == [1, 2, 3, 4] and sr.start_pos == 0 and sr.sample
    assert [u.new_token_ids for u in ups] == [(5,)]
    out, ups = step(s)
    assert list(out.requests[0].token_ids) == [5] and out.requests[0].start_pos == 4
    _, ups = step(s)
    assert ups[0].new_token_ids == (7,) and ups[0].finish_reason is FinishReason.LENGTH
    assert not s.has_work()
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    assert s.schedule().is_empty  # not executed, so the finished id waits for a real step
    s.add_request(make_request("b"))
    assert s.schedule().finished_request_ids == frozenset({"a"})


def test_token_budget_is_respected_and_running_goes_first() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", prompt_len=6))
    s.add_request(make_request("b", prompt_len=6))
    out, _ = step(s)
    assert out.num_tokens == 10
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [
        ("a", 6, True), ("b", 4, False)]
    out, _ = step(s)
    # a decodes (1 token) before b's remaining 2 prompt tokens.
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("a", 1), ("b", 2)]


def test_long_prompt_is_chunked_across_steps() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("a", prompt_len=20, max_tokens=2))
    chunks = []
    while True:
        out, ups = step(s)
        r = out.requests[0]
        chunks.append((r.start_pos, len(r.token_ids), r.sample))
        if ups:
            break
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert ups[0].new_token_ids == (21,)
    assert len(out.requests[0].block_ids) == 5  # 20 tokens / block_size 4


def test_max_num_seqs_limits_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert s.stats().num_running == 2 and s.stats().num_waiting == 1
    results = run_to_completion(s)
    assert all(results[rid][-1].finish_reason is FinishReason.LENGTH for rid in "abc")


def test_preemption_by_recompute_frees_newest() -> None:
    # 4 blocks of 2 tokens: two requests of 4 prompt tokens fill the cache.
    s = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    s.add_request(make_request("a", prompt_len=4, max_tokens=3))
    s.add_request(make_request("b", prompt_len=4, max_tokens=3))
    out, ups = step(s)
    assert {u.request_id for u in ups} == {"a", "b"}
    assert s.kv_cache.num_free_blocks == 0
    # a's decode needs a fifth block: b (the newest) is preempted.
    out, ups = step(s)
    assert [r.request_id for r in out.requests] == ["a"]
    b = s.requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    results = run_to_completion(s)
    # b recomputes prompt + its first token, then continues where it left off.
    tokens_b = [t for u in [*ups, *results["b"]] if u.request_id == "b" for t in u.new_token_ids]
    assert tokens_b == [6, 7]
    assert results["b"][-1].finish_reason is FinishReason.LENGTH
    assert s.kv_cache.num_free_blocks == 4


def test_preempted_request_resumes_on_cached_prefix_then_its_outputs() -> None:
    s = make_scheduler(num_blocks=4, block_size=2)
    s.add_request(make_request("a", prompt_len=4, max_tokens=3))
    s.add_request(make_request("b", prompt_len=4, max_tokens=3))
    step(s)
    step(s)  # preempts b, which had one output token (5)
    out = s.schedule()
    # b shares a's two cached prompt blocks, so the one free block is enough to
    # readmit it next to a; only its output token (5) is recomputed.
    [_, sr] = out.requests
    assert (sr.request_id, list(sr.token_ids), sr.start_pos, sr.sample) == (
        "b", [5], 4, True)
    assert s.kv_cache.block_ids("b")[:2] == s.kv_cache.block_ids("a")[:2]
    ups = s.update_from_output(out, RunnerOutput(fake_execute(out)))
    assert [(u.request_id, u.new_token_ids) for u in ups] == [("a", (7,)), ("b", (6,))]


def test_not_admitting_readmits_preempted_but_not_new_requests() -> None:
    # A "wait" pause: what ran when it came finishes, preempted ones included.
    s = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    s.add_request(make_request("a", prompt_len=4, max_tokens=3))
    s.add_request(make_request("b", prompt_len=4, max_tokens=3))
    step(s)
    s.admitting = False
    s.add_request(make_request("new", prompt_len=2, max_tokens=1))
    step(s)  # a's decode preempts b
    assert s.requests["b"].status is RequestStatus.WAITING
    finished = []
    for _ in range(20):
        finished += [u.request_id for u in step(s)[1] if u.finished]
    assert sorted(finished) == ["a", "b"]
    assert s.requests["new"].status is RequestStatus.WAITING and not s.running
    s.admitting = True
    assert run_to_completion(s)["new"][-1].finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_and_drops_pending_output() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=8))
    s.add_request(make_request("b", prompt_len=8))
    step(s)
    s.add_request(make_request("c"))
    used = s.kv_cache.num_blocks - s.kv_cache.num_free_blocks
    assert used == 4
    out = s.schedule()
    ups = s.abort_requests(["a", "c", "missing"])
    assert [(u.request_id, u.finish_reason) for u in ups] == [
        ("a", FinishReason.ABORT), ("c", FinishReason.ABORT)]
    updates = s.update_from_output(out, RunnerOutput(fake_execute(out)))
    assert [u.request_id for u in updates] == ["b"]
    assert s.kv_cache.num_blocks - s.kv_cache.num_free_blocks == 3  # b: 9 tokens -> 3 blocks
    assert s.schedule().finished_request_ids == frozenset({"a", "c"})
    s.kv_cache.check_integrity()


def test_eos_stops_unless_ignored() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", max_tokens=5))
    s.add_request(make_request("b", max_tokens=5, ignore_eos=True))
    _, ups = step(s, {"a": 0, "b": 0})
    assert [(u.request_id, u.finish_reason) for u in ups] == [
        ("a", FinishReason.EOS_TOKEN), (("b", None))]


def test_stop_token_reports_matched_id() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", stop_token_ids=(7, 9), ignore_eos=True))
    _, ups = step(s, {"a": 0})  # EOS, ignored
    assert ups[0].finish_reason is None
    _, ups = step(s, {"a": 9})
    assert ups[0].finish_reason is FinishReason.STOP_TOKEN and ups[0].stop_token_id == 9


def test_min_tokens_defers_eos() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", min_tokens=2))
    assert step(s, {"a": 0})[1][0].finish_reason is None
    assert step(s, {"a": 0})[1][0].finish_reason is None
    assert step(s, {"a": 0})[1][0].finish_reason is FinishReason.EOS_TOKEN


def test_context_full_finishes_with_length() -> None:
    s = make_scheduler(max_model_len=6)
    s.add_request(make_request("a", prompt_len=4, max_tokens=None))
    results = run_to_completion(s)
    assert [u.new_token_ids for u in results["a"]] == [(5,), (6,)]
    assert results["a"][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("max_model_len", "prompt_len", "max_tokens", "match"),
    [
        (16, 0, 4, "empty"),
        (16, 16, 4, "max_model_len is 16"),
        (64, 8, 100, "whole KV cache holds 8"),
    ],
)
def test_rejects_requests_that_can_never_run(
    max_model_len: int, prompt_len: int, max_tokens: int, match: str
) -> None:
    s = make_scheduler(num_blocks=8, block_size=2, max_model_len=max_model_len)
    with pytest.raises(RequestRejected, match=match):
        s.add_request(make_request("a", prompt_len=prompt_len, max_tokens=max_tokens))
    assert not s.has_work()


def test_duplicate_request_id_is_rejected() -> None:
    s = make_scheduler()
    s.add_request(make_request("a"))
    with pytest.raises(RequestRejected, match="already in use"):
        s.add_request(make_request("a"))


def test_priority_policy_admits_lowest_value_first() -> None:
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio in [("low", 5), ("high", -1), ("mid", 0)]:
        req = make_request(rid, max_tokens=1)
        req.priority = prio
        s.add_request(req)
    order = []
    while s.has_work():
        out, _ = step(s)
        order += [r.request_id for r in out.requests]
    assert order == ["high", "mid", "low"]


def test_many_requests_under_pressure_all_finish() -> None:
    s = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    for i in range(10):
        s.add_request(make_request(f"r{i}", prompt_len=3 + i, max_tokens=5 + i % 3))
    results = run_to_completion(s)
    for i in range(10):
        tokens = [t for u in results[f"r{i}"] for t in u.new_token_ids]
        assert tokens == list(range(4 + i, 4 + i + 5 + i % 3))
    assert s.kv_cache.num_free_blocks == 12


def prompt_step(s: Scheduler) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """A step whose fake runner reports prompt logprobs where the scheduler asks."""
    out = s.schedule()
    prompt = {
        sr.request_id: [PositionLogprobs(sr.prompt_token_ids[p + 1], -1.0, 1)
                        for p in range(sr.start_pos, min(sr.start_pos + len(sr.token_ids),
                                                         len(sr.prompt_token_ids) - 1))]
        for sr in out.requests if sr.prompt_logprobs is not None
    }
    return out, s.update_from_output(out, RunnerOutput(fake_execute(out), prompt_logprobs=prompt))


def test_prompt_logprobs_gather_over_chunks_and_skip_the_cache() -> None:
    s = make_scheduler(max_num_batched_tokens=6)
    s.add_request(make_request("warm", prompt_len=13, max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("asks", prompt_len=13, max_tokens=2, prompt_logprobs=2))
    out, ups = prompt_step(s)
    assert out.requests[0].start_pos == 0  # the cached prefix is not used
    assert out.requests[0].prompt_logprobs == 2 and not ups
    _, ups = prompt_step(s)
    _, ups = prompt_step(s)
    [first] = ups
    assert [lp.token_id for lp in first.prompt_logprobs] == list(range(2, 14))
    assert first.num_cached_tokens == 0
    out, ups = prompt_step(s)
    assert out.requests[0].prompt_logprobs is None and not ups[0].prompt_logprobs


# ---- batches in flight (a batch queue deeper than 1) -------------------------------


def run_pipelined(s: Scheduler, depth: int = 2,
                  max_steps: int = 2000) -> dict[str, list[RequestUpdate]]:
    """Schedule up to `depth` batches ahead of their updates, as the engine's batch
    queue does, applying each batch's outputs in order."""
    in_flight: list[SchedulerOutput] = []
    updates: dict[str, list[RequestUpdate]] = {}
    for _ in range(max_steps):
        if not s.has_work() and not in_flight:
            return updates
        if len(in_flight) < depth:
            out = s.schedule()
            if not out.is_empty:
                in_flight.append(out)
                if len(in_flight) < depth:
                    continue
        if in_flight:
            out = in_flight.pop(0)
            for u in s.update_from_output(out, RunnerOutput(fake_execute(out))):
                updates.setdefault(u.request_id, []).append(u)
    raise AssertionError("did not finish")


def test_request_in_flight_is_not_scheduled_again() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", prompt_len=6, max_tokens=2))
    first = s.schedule()
    # The rest of the prompt may follow while the first chunk executes ...
    second = s.schedule()
    assert [(r.start_pos, len(r.token_ids), r.sample) for r in first.requests] == [(0, 4, False)]
    assert [(r.start_pos, len(r.token_ids), r.sample) for r in second.requests] == [(4, 2, True)]
    # ... but nothing more until the token sampled at its end is known.
    assert s.schedule().is_empty
    s.update_from_output(first, RunnerOutput({}))
    assert s.schedule().is_empty
    ups = s.update_from_output(second, RunnerOutput(fake_execute(second)))
    assert [u.new_token_ids for u in ups] == [(7,)]
    third = s.schedule()
    assert [(r.start_pos, list(r.token_ids)) for r in third.requests] == [(6, [7])]


def test_outputs_of_a_preempted_request_in_flight_are_dropped() -> None:
    s = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=64)
    s.add_request(make_request("a", prompt_len=4, max_tokens=3))
    s.add_request(make_request("b", prompt_len=3, max_tokens=3))
    first = s.schedule()
    s.update_from_output(first, RunnerOutput(fake_execute(first)))
    in_flight = s.schedule()  # a and b decode
    assert {r.request_id for r in in_flight.requests} == {"a", "b"}
    b = s.requests["b"]
    s._preempt(b)  # as a later schedule would when a block runs out
    ups = s.update_from_output(in_flight, RunnerOutput(fake_execute(in_flight)))
    assert [u.request_id for u in ups] == ["a"]
    assert b.num_computed_tokens == 0 and b.num_inflight_tokens == 0
    results = run_to_completion(s)
    tokens_b = [t for u in [*results["b"]] for t in u.new_token_ids]
    assert tokens_b == [5, 6]  # 4 was reported by the first step: nothing lost or repeated


@pytest.mark.parametrize("depth", [2, 3])
def test_pipelined_schedule_gives_the_same_tokens(depth: int) -> None:
    def fill(s: Scheduler) -> None:
        for i in range(10):
            s.add_request(make_request(f"r{i}", prompt_len=3 + i, max_tokens=5 + i % 3))

    serial = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16,
                            max_num_seqs=6)
    fill(serial)
    expected = run_to_completion(serial)
    piped = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=6)
    fill(piped)
    got = run_pipelined(piped, depth)

    def toks(results: dict[str, list[RequestUpdate]]) -> dict[str, list[int]]:
        return {k: [t for u in v for t in u.new_token_ids] for k, v in results.items()}

    assert toks(got) == toks(expected)
    assert piped.kv_cache.num_free_blocks == 12


def test_a_step_that_admits_nothing_runs_only_the_running_requests() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=4))
    step(s)
    s.add_request(make_request("b", prompt_len=4))
    out = s.schedule(admit=False)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("a", 1)]
    s.update_from_output(out, RunnerOutput(fake_execute(out)))
    assert [r.request_id for r in s.schedule().requests] == ["a", "b"]
