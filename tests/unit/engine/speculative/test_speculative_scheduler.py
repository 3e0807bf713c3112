"""The scheduler with a speculator, on a fake model whose next token is a function of
the tokens so far (no torch): drafts take budget and free slots only, the outputs equal
those without drafts, and rejected drafts give their slots back."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.scheduler.scheduler import Scheduler
from services.engine.speculative.config import SpeculativeConfig
from services.engine.speculative.speculator import Speculator
from tests.unit.engine.scheduler_helpers import make_request, make_scheduler

PERIOD = 7


def next_token(context: Sequence[int]) -> int:
    """A model that counts up to PERIOD and starts over, with a hiccup every 23 tokens
    (so that some drafts are rejected)."""
    if len(context) % 23 == 0:
        return 100 + len(context) % 5
    return (context[-1] + 1) % PERIOD + 1


def execute(s: Scheduler, out: SchedulerOutput) -> RunnerOutput:
    """What a runner returns: per position, the model's token given what precedes it
    (the drafts before it included); drafts kept up to the first disagreement."""
    result = RunnerOutput()
    for sr in out.requests:
        if not sr.sample:
            continue
        req = s.requests[sr.request_id]
        context = req.token_slice(0, req.num_tokens)
        k = sr.num_draft_tokens
        if not k:
            result.sampled[sr.request_id] = next_token(context)
            continue
        drafts = list(sr.token_ids[len(sr.token_ids) - k:])
        tokens: list[int] = []
        for d in [*drafts, None]:
            target = next_token(context + tokens)
            tokens.append(target)
            if target != d:
                break
        result.verified[sr.request_id] = tokens
    return result


def spec_scheduler(num_tokens: int = 4, **kwargs: int) -> Scheduler:
    s = make_scheduler(**kwargs)
    s.speculator = Speculator(SpeculativeConfig("ngram", num_tokens, 2, 4,
                                                disable_by_batch_size=8))
    return s


def run(s: Scheduler, requests: list[Request], max_steps: int = 2000,
        ) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    for r in requests:
        s.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    outs = []
    for _ in range(max_steps):
        if not s.has_work():
            return tokens, outs
        out = s.schedule()
        outs.append(out)
        updates: list[RequestUpdate] = s.update_from_output(out, execute(s, out))
        for u in updates:
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        s.kv_cache.check_integrity()
    raise AssertionError("did not finish")


def requests(n: int = 3, max_tokens: int = 60, spread: int = 0) -> list[Request]:
    return [make_request(f"r{i}", prompt_len=5 + 3 * i, max_tokens=max_tokens + spread * i)
            for i in range(n)]


def test_outputs_equal_those_without_drafts_and_drafts_are_accepted() -> None:
    plain, plain_steps = run(make_scheduler(), requests())
    s = spec_scheduler()
    spec, spec_steps = run(s, requests())
    assert spec == plain
    assert all(len(t) == 60 for t in spec.values())
    stats = s.stats().speculation
    assert stats is not None and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # the hiccups reject some
    assert stats.mean_accepted_length > 2
    assert len(spec_steps) < len(plain_steps) * 0.6
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    # Drafts count against the step's budget like any token.
    assert all(o.num_tokens <= s.max_num_batched_tokens for o in spec_steps)


def test_drafts_respect_max_tokens_max_model_len_and_the_budget() -> None:
    s = spec_scheduler(num_tokens=8, max_model_len=40, max_num_batched_tokens=6)
    out, _ = run(s, [make_request("a", prompt_len=10, max_tokens=23),
                     make_request("b", prompt_len=12, max_tokens=None)])
    assert len(out["a"]) == 23
    assert len(out["b"]) == 40 - 12  # to max_model_len, not past it
    stats = s.stats().speculation
    assert stats is not None and stats.num_drafts > 0


def test_a_draft_never_preempts_and_rejected_slots_are_freed() -> None:
    # 12 blocks of 4: two requests of ~40 tokens cannot both hold lookahead slots.
    s = spec_scheduler(num_tokens=8, num_blocks=24, block_size=4)
    plain, _ = run(make_scheduler(num_blocks=24, block_size=4), requests(2, 40))
    spec, outs = run(s, requests(2, 40))
    assert spec == plain
    assert s.num_preemptions == 0
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def test_after_a_verify_a_request_holds_only_the_blocks_its_tokens_need() -> None:
    s = spec_scheduler(num_tokens=8, block_size=2)
    r = make_request("a", prompt_len=6, max_tokens=60)
    s.add_request(r)
    for _ in range(40):
        out = s.schedule()
        s.update_from_output(out, execute(s, out))
        # Never the slots of rejected drafts: at most what its tokens fill.
        assert len(s.kv_cache.block_ids("a")) <= s.kv_cache.blocks_needed(r.num_tokens)
    assert r.num_computed_tokens == r.num_tokens - 1


def test_no_drafts_in_a_step_with_more_running_than_disable_by_batch_size() -> None:
    s = make_scheduler()
    s.speculator = Speculator(SpeculativeConfig("ngram", 4, 2, 4, disable_by_batch_size=2))
    _, outs = run(s, requests(3, max_tokens=20, spread=20))
    busy = [o for o in outs if len(o.requests) == 3]
    assert busy and not any(r.num_draft_tokens for o in busy for r in o.requests)
    stats = s.stats().speculation
    assert stats is not None and stats.num_drafts > 0  # once fewer were running


def test_a_request_whose_drafts_fail_backs_off() -> None:
    spec = Speculator(SpeculativeConfig("ngram", 4, 2, 4, min_acceptance_rate=0.5))
    r = make_request("a", prompt_len=4)
    r.prompt_token_ids = [1, 2, 3, 1, 2, 3, 1, 2]
    assert spec.propose(r, 4) == [3, 1, 2]  # the longest match, though short
    spec.record("a", 4, 0)  # rate 0.5 -> still proposing
    assert spec.propose(r, 4)
    spec.record("a", 4, 0)  # below: skip 4 steps
    assert [spec.propose(r, 4) for _ in range(4)] == [[]] * 4
    assert spec.propose(r, 4)
    spec.record("a", 4, 0)  # still low: skip 8
    assert [bool(spec.propose(r, 4)) for _ in range(9)] == [False] * 8 + [True]
    spec.record("a", 4, 4)  # good again (rate 0.75): back to the first backoff
    spec.record("a", 4, 0)  # 0.375: skip 4
    assert [bool(spec.propose(r, 4)) for _ in range(5)] == [False] * 4 + [True]


def test_preemption_and_unschedule_drop_drafts_in_flight() -> None:
    s = spec_scheduler(num_tokens=4)
    r = make_request("a", prompt_len=8, max_tokens=100)
    r.prompt_token_ids = [1, 3, 5, 7, 2, 4, 6, 1, 3]  # the fake model's own cycle
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, execute(s, out))
    out = s.schedule()
    [sr] = out.requests
    assert sr.num_draft_tokens > 0 and r.num_uncomputed_tokens == 0
    s.unschedule(out)
    assert r.num_draft_tokens == 0 and r.num_uncomputed_tokens == 1
    out = s.schedule()
    assert out.requests[0].num_draft_tokens > 0
    s._preempt(r)  # noqa: SLF001
    assert r.num_draft_tokens == 0 and r.num_inflight_tokens == 0
    # The stale verify (an earlier attempt) changes nothing.
    s.update_from_output(out, execute(s, out))
    assert r.num_output_tokens == 1
    run(s, [])
    assert r.num_output_tokens == 100


def draft_scheduler(limit: int = 2, **kwargs: int) -> Scheduler:
    s = make_scheduler(**kwargs)
    s.speculator = Speculator(SpeculativeConfig("draft_model", 3, disable_by_batch_size=limit,
                                                model="draft"))
    return s


def test_a_draft_model_is_asked_for_lookahead_only_when_the_batch_is_small() -> None:
    s = draft_scheduler(limit=2)
    for r in requests(3):
        s.add_request(r)
    burst = s.schedule()  # three admitted at once: over the limit, no lookahead
    assert all(sr.num_lookahead == 0 for sr in burst.requests)
    s.update_from_output(burst, execute(s, burst))
    s.abort_requests(["r2"])
    out = s.schedule()
    assert [sr.num_lookahead for sr in out.requests] == [3, 3]
    for sr in out.requests:  # slots for the draft's pass: the step's token and 3 more
        assert len(sr.block_ids) * 4 >= sr.start_pos + 1 + 3
    result = execute(s, out)
    result.draft_tokens.update({sr.request_id: [7, 8, 9] for sr in out.requests})
    s.update_from_output(out, result)
    for sr in out.requests:
        req = s.requests[sr.request_id]
        assert len(s.kv_cache.block_ids(req.request_id)) == s.kv_cache.blocks_needed(
            req.num_tokens)  # the lookahead slots are back
    nxt = s.schedule()
    assert all(list(sr.token_ids[1:]) == [7, 8, 9] for sr in nxt.requests)
    assert all(sr.num_draft_tokens == 3 for sr in nxt.requests)
