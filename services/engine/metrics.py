"""The engine's Prometheus metrics and per-request spans, fed by the busy loop.

Gauges and cumulative counts that the scheduler already keeps (running, waiting,
KV usage, prefix cache, preemptions, steps, engine state) are read from the
latest SchedulerStats when Prometheus scrapes, so they cost the loop nothing.
So are the tensor-parallel size and the model calls each rank has finished (the
executor's progress slots, in shared memory): a worker whose count stops while
rank 0's goes on is stalled. The loop's hooks (see core/observer.py) only stamp times
and add token counts.

Tracing: each request gets one span over its life in this engine, child of the
frontend's span (the add message's `trace_headers`), with child spans for the
queue wait, the prefill (up to the first token) and the decode, which is
summarised (steps, tokens): never a span per token. The request span carries the
engine's tensor-parallel size. The spans are built after
the request ends, from the recorded timestamps, on a thread of their own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common import tracing as tr
from services.common.metrics import PREFIX, REQUEST_LATENCY_BUCKETS
from services.common.thread_names import name_native_thread
from services.common.tracing import Tracing
from services.engine.core.iteration_details import IterationDetails
from services.engine.core.observer import EngineObserver
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.output import SchedulerOutput
from services.engine.scheduler.scheduler import SchedulerStats
from services.engine.speculative.speculator import SpeculationStats

log = logging.getLogger(__name__)

LABELS = ("model_name", "engine")
# Compiles take ~1 ms typically, up to seconds for huge grammars; masks tens of µs a row.
GRAMMAR_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                           1.0, 2.5, 5.0, 10.0, 30.0)
GRAMMAR_MASK_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                        0.01, 0.025, 0.05, 0.1)
# Iteration details (--iteration-details): a step's tokens, and its phases (from tens
# of µs to schedule up to seconds for a long prefill's forward).
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ITERATION_PHASE_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                           0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ITERATION_PHASES = ("schedule", "forward", "sample", "update")
_NS = 1_000_000_000


@dataclass(slots=True)
class _Tracked:
    """Timestamps (time.time()) of one request in this engine."""

    request: Request
    added: float
    scheduled: float = 0.0
    first_token: float = 0.0


@dataclass(frozen=True, slots=True)
class _Finished:
    tracked: _Tracked
    update: RequestUpdate
    finished: float


class _StatsCollector(Collector):
    """What the scheduler's stats and the engine state say, read at scrape time."""

    def __init__(self, labels: list[str], stats: Callable[[], SchedulerStats],
                 state: Callable[[], EngineState], last_step: Callable[[], float]) -> None:
        self._labels = labels
        self._stats = stats
        self._state = state
        self._last_step = last_step

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        names = list(LABELS)
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             s.kv_cache_usage),
            ("last_step_timestamp_seconds", "Unix time of the latest engine step (0: none).",
             self._last_step()),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            gauge.add_metric(self._labels, value)
            yield gauge
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted (to be recomputed).",
             s.num_preemptions),
            ("num_prefix_waits", "Times a waiting request was held back a step for "
             "prompt blocks that running requests were computing (then it reuses them).",
             s.num_prefix_waits),
            ("engine_steps", "Busy-loop steps scheduled.", s.step_counter),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=names)
            counter.add_metric(self._labels, value)
            yield counter
        if s.speculation is not None:
            yield from _speculation_metrics(s.speculation, names, self._labels)
        state = self._state()
        family = GaugeMetricFamily(
            PREFIX + "engine_state",
            "1 for the engine's current lifecycle state, 0 for the others.",
            labels=[*names, "state"])
        for candidate in EngineState:
            family.add_metric([*self._labels, candidate.name], float(candidate is state))
        yield family


def _speculation_metrics(spec: SpeculationStats, names: list[str],
                         labels: list[str]) -> Iterator[Metric]:
    """vLLM's spec_decode counters (mean accepted length = 1 + accepted / drafts)."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verify steps of requests that had draft tokens.",
         spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
         spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
         spec.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(PREFIX + name, doc, labels=names)
        counter.add_metric(labels, value)
        yield counter
    family = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each position of the drafts (0 first).",
        labels=[*names, "position"])
    for position, value in enumerate(spec.accepted_per_position):
        family.add_metric([*labels, str(position)], value)
    yield family


class _RanksCollector(Collector):
    """The executor's tensor-parallel ranks, read at scrape time."""

    def __init__(self, labels: list[str], executor: Executor) -> None:
        self._labels = labels
        self._executor = executor

    def collect(self) -> Iterator[Metric]:
        executor = self._executor
        names = list(LABELS)
        gauge = GaugeMetricFamily(PREFIX + "tensor_parallel_size",
                                  "Ranks the engine's model runs over.", labels=names)
        gauge.add_metric(self._labels, executor.tensor_parallel_size)
        yield gauge
        calls = CounterMetricFamily(
            PREFIX + "tensor_parallel_calls",
            "Model calls finished per tensor-parallel rank (rank 0: calls handed to the "
            "workers; none at one rank).", labels=[*names, "rank"])
        for rank, count in enumerate(executor.rank_progress()):
            calls.add_metric([*self._labels, str(rank)], count)
        yield calls


class EngineMetrics(EngineObserver):
    """Prometheus metrics (into `registry`) and request spans (with `tracing`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_index: int,
                 stats: Callable[[], SchedulerStats], state: Callable[[], EngineState],
                 tracing: Tracing | None = None, executor: Executor | None = None) -> None:
        """`executor`: the model's, whose tensor-parallel ranks the metrics and request
        spans report (none: not reported)."""
        labels = [model_name, str(engine_index)]
        self._model_name = model_name
        self._engine_index = engine_index
        self._tracked: dict[str, _Tracked] = {}
        self._unscheduled: set[str] = set()
        self._awaiting_first_token: set[str] = set()
        self.last_step_time = 0.0
        self._executor = executor
        registry.register(_StatsCollector(labels, stats, state, lambda: self.last_step_time))
        if executor is not None:
            registry.register(_RanksCollector(labels, executor))

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, LABELS, registry=registry).labels(*labels)

        def histogram(name: str, doc: str,
                      buckets: tuple[float, ...] = REQUEST_LATENCY_BUCKETS) -> Any:
            return Histogram(PREFIX + name, doc, LABELS, registry=registry,
                             buckets=buckets).labels(*labels)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.watchdog_trips = counter("watchdog_trips", "Times the watchdog found the loop stuck.")
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from the engine taking a request to its first step.")
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from a request's first step to its first token.")
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from a request's first token to its end.")
        self.constrained_requests = counter(
            "constrained_requests", "Requests with an output constraint (structured output).")
        self.grammar_compile_time = histogram(
            "grammar_compile_time_seconds",
            "Time to compile an output constraint (cache hits are not observed).",
            GRAMMAR_COMPILE_BUCKETS)
        self.grammar_mask_time = histogram(
            "grammar_mask_time_seconds",
            "Time to build one step's token bitmask of the constrained requests.",
            GRAMMAR_MASK_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens", "Tokens one step ran (recorded with iteration details).",
            ITERATION_TOKEN_BUCKETS)
        self.iteration_prefill_tokens = histogram(
            "iteration_prefill_tokens",
            "Prompt tokens one step ran (recorded with iteration details).",
            ITERATION_TOKEN_BUCKETS)
        phases = Histogram(PREFIX + "iteration_phase_seconds",
                           "Time one step spent in a phase: schedule, forward, sample, update "
                           "(recorded with iteration details).", (*LABELS, "phase"),
                           registry=registry, buckets=ITERATION_PHASE_BUCKETS)
        self.iteration_phases = [phases.labels(*labels, phase) for phase in ITERATION_PHASES]
        self._tracing = tracing if tracing is not None and tracing.enabled else None
        self._finished: queue.SimpleQueue[_Finished | None] = queue.SimpleQueue()
        self._span_thread: threading.Thread | None = None
        if self._tracing is not None:
            self._span_thread = threading.Thread(target=self._build_spans, name="engine-spans",
                                                 daemon=True)
            self._span_thread.start()

    # ---- hooks, on the loop thread (keep them cheap) ----------------------------

    def on_added(self, request: Request) -> None:
        self._tracked[request.request_id] = _Tracked(request, time.time())
        if request.sampling.constraint is not None:
            self.constrained_requests.inc()
        self._unscheduled.add(request.request_id)
        self._awaiting_first_token.add(request.request_id)

    def on_scheduled(self, out: SchedulerOutput) -> None:
        now = self.last_step_time = time.time()
        if not self._unscheduled:
            return
        for sr in out.requests:
            if sr.request_id in self._unscheduled:
                self._unscheduled.discard(sr.request_id)
                t = self._tracked[sr.request_id]
                t.scheduled = now
                self.queue_time.observe(now - t.added)

    def on_iteration(self, details: IterationDetails) -> None:
        self.iteration_tokens.observe(details.num_tokens)
        self.iteration_prefill_tokens.observe(details.num_prefill_tokens)
        for histogram, seconds in zip(self.iteration_phases, (
                details.schedule_s, details.forward_s, details.sample_s, details.update_s),
                strict=True):
            histogram.observe(seconds)

    def on_updates(self, updates: Sequence[RequestUpdate]) -> None:
        # Most updates are one decode token of a running request: only a request's
        # first token and its end need its record.
        now = time.time()
        generated = prompt = 0
        for u in updates:
            generated += len(u.new_token_ids)
            if u.new_token_ids and u.request_id in self._awaiting_first_token:
                self._awaiting_first_token.discard(u.request_id)
                t = self._tracked[u.request_id]
                t.first_token = now
                prompt += t.request.num_prompt_tokens
                if t.scheduled:
                    self.prefill_time.observe(now - t.scheduled)
            if u.finish_reason is not None:
                self._finish(u, now)
        if generated:
            self.generation_tokens.inc(generated)
        if prompt:
            self.prompt_tokens.inc(prompt)

    def _finish(self, u: RequestUpdate, now: float) -> None:
        t = self._tracked.pop(u.request_id, None)
        if t is None:
            return  # rejected before the scheduler took it
        self._unscheduled.discard(u.request_id)
        self._awaiting_first_token.discard(u.request_id)
        if t.first_token:
            self.decode_time.observe(now - t.first_token)
        if self._tracing is not None:
            self._finished.put(_Finished(t, u, now))

    def on_grammar_compiled(self, seconds: float, cached: bool) -> None:
        if not cached:
            self.grammar_compile_time.observe(seconds)

    def on_grammar_mask(self, seconds: float, rows: int) -> None:
        self.grammar_mask_time.observe(seconds)

    def on_state(self, state: EngineState, death_reason: str = "") -> None:
        if state is EngineState.DEAD and death_reason.startswith("watchdog"):
            self.watchdog_trips.inc()

    def close(self, timeout_s: float = 2.0) -> None:
        """Build the spans of requests that have ended, then stop the span thread."""
        if self._span_thread is not None:
            self._finished.put(None)
            self._span_thread.join(timeout_s)

    # ---- spans, on their own thread ---------------------------------------------

    def _build_spans(self) -> None:
        name_native_thread()
        while (item := self._finished.get()) is not None:
            try:
                self._request_span(item)
            except Exception:
                log.exception("could not record the spans of a request")

    def _request_span(self, item: _Finished) -> None:
        assert self._tracing is not None
        t, u, request = item.tracked, item.update, item.tracked.request
        tracer = self._tracing.tracer
        parent = tr.extract(request.trace_headers)
        finished = item.finished
        first_token = t.first_token or finished
        scheduled = t.scheduled or first_token
        num_output = request.num_output_tokens
        sampling = request.sampling
        reason = u.finish_reason.name.lower() if u.finish_reason is not None else "unknown"
        attributes: dict[str, Any] = {
            tr.GEN_AI_SYSTEM: tr.GEN_AI_SYSTEM_NAME,
            tr.GEN_AI_MODEL: self._model_name,
            tr.GEN_AI_RESPONSE_ID: request.request_id,
            tr.GEN_AI_INPUT_TOKENS: request.num_prompt_tokens,
            tr.GEN_AI_OUTPUT_TOKENS: num_output,
            tr.GEN_AI_FINISH_REASONS: [reason],
            tr.LATENCY_QUEUE: scheduled - t.added,
            tr.LATENCY_PREFILL: first_token - scheduled,
            tr.LATENCY_DECODE: finished - first_token,
            tr.LATENCY_E2E: finished - t.added,
            "corestream.engine.index": self._engine_index,
            "corestream.engine.num_preemptions": request.num_preemptions,
            "corestream.engine.num_cached_tokens": request.num_cached_tokens,
        }
        if self._executor is not None:
            attributes["corestream.engine.tensor_parallel_size"] = (
                self._executor.tensor_parallel_size)
        if t.first_token:
            attributes[tr.LATENCY_TTFT] = t.first_token - t.added
        if sampling.max_tokens is not None:
            attributes[tr.GEN_AI_MAX_TOKENS] = sampling.max_tokens
        if sampling.temperature is not None:
            attributes[tr.GEN_AI_TEMPERATURE] = sampling.temperature
        if u.error_message:
            attributes["error.type"] = u.error_message[:200]
        # A constrained request reached the engine when its compile began.
        arrived = request.grammar_compile[0] if request.grammar_compile else t.added
        span = tracer.start_span("engine.request", context=parent, kind=trace.SpanKind.SERVER,
                                 attributes=attributes, start_time=_ns(arrived))
        span.add_event("queued", timestamp=_ns(t.added))
        if t.scheduled:
            span.add_event("scheduled", timestamp=_ns(t.scheduled))
        if t.first_token:
            span.add_event("first_token", timestamp=_ns(t.first_token))
        inside = trace.set_span_in_context(span)
        if request.grammar_compile is not None:
            constraint = sampling.constraint
            compile_start, compile_end = request.grammar_compile
            child = tracer.start_span(
                "engine.grammar_compile", context=inside, start_time=_ns(compile_start),
                attributes={"corestream.constraint.kind":
                            constraint.kind.value if constraint else "",
                            "corestream.constraint.chars": constraint.size if constraint else 0})
            child.end(end_time=_ns(compile_end))
        for name, start, end, extra in (
            ("engine.queue", t.added, scheduled, {}),
            ("engine.prefill", scheduled, first_token,
             {"corestream.prefill.tokens": request.num_prompt_tokens - request.num_cached_tokens}),
            ("engine.decode", first_token, finished,
             {"corestream.decode.steps": max(num_output - 1, 0),
              "corestream.decode.tokens": max(num_output - 1, 0)}),
        ):
            child = tracer.start_span(name, context=inside, start_time=_ns(start),
                                      attributes=extra)
            child.end(end_time=_ns(end))
        if u.finish_reason is not None and u.finish_reason.name == "ERROR":
            span.set_status(trace.Status(trace.StatusCode.ERROR, u.error_message[:200]))
        span.end(end_time=_ns(finished))


def _ns(seconds: float) -> int:
    return int(seconds * _NS)
