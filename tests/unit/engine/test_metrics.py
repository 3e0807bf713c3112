"""EngineMetrics driven by the real scheduler: counters, stats read at scrape time, spans."""

from __future__ import annotations

import dataclasses

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from services.common.constraints import ConstraintKind, OutputConstraint
from services.common.metrics import new_registry
from services.common.observability_config import ObservabilityConfig
from services.common.sampling import SamplingParams
from services.common.tracing import Tracing
from services.engine.messages import EngineState
from services.engine.metrics import EngineMetrics
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.output import RunnerOutput
from services.engine.scheduler.scheduler import Scheduler

LABELS = {"model_name": "tiny", "engine": "3"}
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


class Harness:
    """The real scheduler, a 'model' that always samples token 7, and the engine
    core's three hook calls."""

    def __init__(self, tracing: Tracing | None = None, num_blocks: int = 64,
                 executor: object = None) -> None:
        self.scheduler = Scheduler(KVCacheManager(num_blocks, 4), max_model_len=256,
                                   max_num_batched_tokens=64)
        self.state = EngineState.RUNNING
        self.registry = new_registry(process_metrics=False)
        self.metrics = EngineMetrics(self.registry, "tiny", 3, self.scheduler.stats,
                                     lambda: self.state, tracing, executor)  # type: ignore[arg-type]

    def add(self, rid: str, prompt_len: int, max_tokens: int, **kwargs: object) -> Request:
        request = Request(rid, list(range(1, prompt_len + 1)),
                          SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True), **kwargs)  # type: ignore[arg-type]
        self.scheduler.add_request(request)
        self.metrics.on_added(request)
        return request

    def step(self) -> list[RequestUpdate]:
        out = self.scheduler.schedule()
        self.metrics.on_scheduled(out)
        sampled = {sr.request_id: 7 for sr in out.requests if sr.sample}
        updates = self.scheduler.update_from_output(out, RunnerOutput(sampled=sampled))
        self.metrics.on_updates(updates)
        return updates

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, {**LABELS, **labels})
        return 0.0 if value is None else value


def test_counters_and_gauges_follow_the_requests() -> None:
    h = Harness()
    h.add("a", prompt_len=6, max_tokens=3)
    h.add("b", prompt_len=4, max_tokens=5)
    assert h.sample("corestream:num_requests_waiting") == 2
    updates = h.step()
    assert h.sample("corestream:num_requests_running") == 2
    assert h.sample("corestream:prompt_tokens_total") == 10  # both prefills done
    assert h.sample("corestream:request_queue_time_seconds_count") == 2
    generated = sum(len(u.new_token_ids) for u in updates)
    while h.scheduler.has_work():
        generated += sum(len(u.new_token_ids) for u in h.step())
    assert generated == 8
    assert h.sample("corestream:generation_tokens_total") == 8
    assert h.sample("corestream:request_decode_time_seconds_count") == 2
    assert h.sample("corestream:num_requests_running") == 0
    assert h.sample("corestream:engine_steps_total") == 5
    assert h.sample("corestream:prefix_cache_queries_total") == 10
    assert h.sample("corestream:last_step_timestamp_seconds") > 0


def test_engine_state_is_one_hot_and_watchdog_trips_count() -> None:
    h = Harness()
    assert h.sample("corestream:engine_state", state="RUNNING") == 1
    h.state = EngineState.DEAD
    h.metrics.on_state(EngineState.DEAD, "watchdog: the busy loop made no progress")
    h.metrics.on_state(EngineState.DEAD, "RuntimeError: boom")  # not a watchdog trip
    text = generate_latest(h.registry).decode()
    assert 'corestream:engine_state{engine="3",model_name="tiny",state="DEAD"} 1.0' in text
    assert 'corestream:engine_state{engine="3",model_name="tiny",state="RUNNING"} 0.0' in text
    assert h.sample("corestream:watchdog_trips_total") == 1


class _Ranks:
    """What the metrics read of a tensor-parallel executor: its size and the model calls
    each rank has finished (the progress slots)."""

    def __init__(self, size: int) -> None:
        self.tensor_parallel_size = size
        self.progress = [0] * size

    def rank_progress(self) -> list[int]:
        return list(self.progress)


def test_tensor_parallel_ranks_are_read_at_scrape_time() -> None:
    without = Harness()
    assert without.registry.get_sample_value("corestream:tensor_parallel_size", LABELS) is None
    ranks = _Ranks(2)
    h = Harness(executor=ranks)
    assert h.sample("corestream:tensor_parallel_size") == 2
    ranks.progress = [5, 5]
    calls = "corestream:tensor_parallel_calls_total"
    assert [h.sample(calls, rank=r) for r in "01"] == [5, 5]
    ranks.progress = [9, 6]  # worker 1 stalled at its 7th call while rank 0 went on
    assert [h.sample(calls, rank=r) for r in "01"] == [9, 6]


def test_preemptions_are_counted() -> None:
    # 6 blocks of 4 tokens: two requests growing to 16 tokens each cannot both fit.
    h = Harness(num_blocks=6)
    h.add("a", prompt_len=8, max_tokens=8)
    h.add("b", prompt_len=8, max_tokens=8)
    while h.scheduler.has_work():
        h.step()
    preemptions = h.scheduler.stats().num_preemptions
    assert preemptions >= 1
    assert h.sample("corestream:num_preemptions_total") == preemptions
    # Every token still counted once, recomputes or not.
    assert h.sample("corestream:generation_tokens_total") == 16


def test_prefix_waits_are_counted() -> None:
    # b's prompt is a's (the harness numbers every prompt 1..n). After a's first chunk
    # (the whole budget), a computes blocks 16-24 that b would compute too: b waits.
    h = Harness()
    h.scheduler.wait_for_prefix_tokens = 8
    h.add("a", prompt_len=100, max_tokens=2)
    h.add("b", prompt_len=100, max_tokens=2)
    assert h.sample("corestream:num_prefix_waits_total") == 0
    h.step()
    h.step()
    assert h.scheduler.stats().num_prefix_waits == 1
    assert h.sample("corestream:num_prefix_waits_total") == 1
    while h.scheduler.has_work():
        h.step()
    assert h.sample("corestream:prefix_cache_hits_total") >= 64  # b reused a's blocks


def test_one_span_per_request_with_phases_and_no_span_per_token() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing("engine", ObservabilityConfig(), exporter=exporter)
    h = Harness(tracing, executor=_Ranks(2))
    headers = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}
    h.add("traced", prompt_len=5, max_tokens=6, trace_headers=headers)
    while h.scheduler.has_work():
        h.step()
    h.metrics.close()
    assert tracing.provider is not None
    tracing.provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["engine.decode", "engine.prefill", "engine.queue", "engine.request"]
    request = spans["engine.request"]
    assert format(request.context.trace_id, "032x") == PARENT_TRACE
    assert format(request.parent.span_id, "016x") == PARENT_SPAN
    attrs = request.attributes
    assert attrs["gen_ai.usage.input_tokens"] == 5
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.latency.time_in_queue"] >= 0
    assert attrs["corestream.engine.index"] == 3
    assert attrs["corestream.engine.tensor_parallel_size"] == 2
    assert [e.name for e in request.events] == ["queued", "scheduled", "first_token"]
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        child = spans[name]
        assert child.parent.span_id == request.context.span_id
        assert request.start_time <= child.start_time <= child.end_time <= request.end_time
    assert spans["engine.decode"].attributes["corestream.decode.steps"] == 5


def test_without_tracing_no_span_thread_runs() -> None:
    h = Harness(Tracing("engine", ObservabilityConfig()))
    assert h.metrics._span_thread is None
    h.add("x", prompt_len=3, max_tokens=2)
    while h.scheduler.has_work():
        h.step()
    h.metrics.close()
    assert h.sample("corestream:generation_tokens_total") == 2


def test_a_constrained_request_has_a_compile_span_inside_its_request_span() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing("engine", ObservabilityConfig(), exporter=exporter)
    h = Harness(tracing)
    request = h.add("json", prompt_len=3, max_tokens=2)
    # As the engine core records it: compile start and end, before the request was added.
    added = h.metrics._tracked["json"].added
    request.sampling = dataclasses.replace(
        request.sampling, constraint=OutputConstraint(ConstraintKind.REGEX, "[0-9]+"))
    request.grammar_compile = (added - 0.25, added - 0.05)
    while h.scheduler.has_work():
        h.step()
    h.metrics.close()
    assert tracing.provider is not None
    tracing.provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    compile_span, parent = spans["engine.grammar_compile"], spans["engine.request"]
    assert compile_span.parent.span_id == parent.context.span_id
    assert parent.start_time == compile_span.start_time  # the request arrived then
    assert abs(compile_span.end_time - compile_span.start_time - 200_000_000) < 1_000
    assert compile_span.attributes["corestream.constraint.kind"] == "regex"
    assert compile_span.attributes["corestream.constraint.chars"] == 6


def test_speculative_decoding_counters_and_every_token_counted() -> None:
    from services.engine.speculative.config import SpeculativeConfig
    from services.engine.speculative.speculator import Speculator

    h = Harness()
    assert h.sample("corestream:spec_decode_num_drafts_total") == 0  # off: not exported
    h.scheduler.speculator = Speculator(SpeculativeConfig("ngram", 3))
    h.add("a", prompt_len=4, max_tokens=20)
    generated = 0
    while h.scheduler.has_work():
        out = h.scheduler.schedule()
        h.metrics.on_scheduled(out)
        # The model always says 7: drafts of 7s are all accepted.
        result = RunnerOutput(
            sampled={sr.request_id: 7 for sr in out.requests if not sr.num_draft_tokens},
            verified={sr.request_id: [7] * (sr.num_draft_tokens + 1)
                      for sr in out.requests if sr.num_draft_tokens})
        updates = h.scheduler.update_from_output(out, result)
        h.metrics.on_updates(updates)
        generated += sum(len(u.new_token_ids) for u in updates)
    assert generated == 20
    assert h.sample("corestream:generation_tokens_total") == 20
    drafts = h.sample("corestream:spec_decode_num_drafts_total")
    proposed = h.sample("corestream:spec_decode_num_draft_tokens_total")
    assert drafts > 0 and proposed > drafts
    assert h.sample("corestream:spec_decode_num_accepted_tokens_total") == proposed
    assert h.sample("corestream:spec_decode_num_accepted_tokens_per_pos_total",
                    position="0") == drafts
