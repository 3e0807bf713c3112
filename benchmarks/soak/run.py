"""The soak driver: a cluster under mixed traffic and seeded faults, then its invariants.

    .venv/bin/python -m benchmarks.soak --minutes 60 [--seed 1] [--rate 8]
    .venv/bin/python -m benchmarks.soak --ci          # 2-3 minutes, every fault kind once

One `corestream serve` (two engines of two tensor-parallel ranks each, the HTTP door,
the engine fault `raise_on_sigusr2` armed) takes requests drawn from the seed
(traffic.py) at a Poisson rate while faults drawn from the seed (faults.py) hit it.
After the traffic: the cluster heals and idles for the quiet period; then every engine
must hold no request and have every KV block free, the processes must hold what they held
once warm, every completed greedy answer must equal a fault-free answer to the same
request, and a last fault-free phase checks the frontend's metrics against the
client's own counts. Everything is printed as a table; the run fails on any violation.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import openai
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.soak import faults as fault_plan
from benchmarks.soak import invariants
from benchmarks.soak.processes import Usage, roles, usage
from benchmarks.soak.traffic import Clients, Outcome, RequestSpec, draw, send
from services.common.ports import free_port
from tests.integration.cluster import Cluster


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 150.0
    """How long traffic runs (faults fall inside it)."""
    rate: float = 6.0
    """Requests a second (Poisson arrivals)."""
    concurrency: int = 12
    """Most requests in flight at once; arrivals past it wait in the client."""
    seed: int = 0
    every_kind_once: bool = True
    """CI mode: each fault kind once, evenly spread; else at `mean_fault_gap_s`."""
    mean_fault_gap_s: float = 90.0
    engines: int = 2
    tensor_parallel: int = 2
    watchdog_s: float = 3.0
    freeze_s: float = 5.0
    """How long stop_engine keeps an engine stopped (past the watchdog)."""
    burst: int = 48
    """Streams the admission burst opens at once."""
    max_num_seqs: int = 8
    max_waiting: int = 4
    warm_s: float = 10.0
    """Fault-free traffic before the processes' warm levels are taken."""
    quiet_s: float = 60.0
    hang_s: float = 90.0
    """A request with no deadline of its own that runs this long has hung."""
    fault_window_s: float = 30.0
    """UNAVAILABLE or a lost connection counts as the faults' doing this long after one."""
    heal_timeout_s: float = 120.0
    rss_drift: float = 0.05
    fd_slack: int = 8
    thread_slack: int = 4
    min_judged_s: float = 60.0
    """Processes that lived less than this after warm-up are not judged for drift."""

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.rate <= 0 or self.concurrency < 1:
            raise ValueError("duration_s, rate and concurrency must be positive")


KV_CACHE_MEMORY = "1MiB"
"""Small, so that the warm-up can touch all of it (see _sweep_kv_pools)."""
SWEEP_TOKENS = 256
SWEEP_BLOCK_TOKENS = 16
"""At least the engines' block size (16 by default): a bound on tokens per block."""

CI_CONFIG = SoakConfig(duration_s=100.0, rate=5.0, quiet_s=10.0, warm_s=8.0,
                       min_judged_s=30.0, rss_drift=0.25, fd_slack=16, thread_slack=16)
"""The CI-sized run: every fault kind once in 100 s. Processes live too briefly there
for a 5% memory bound to mean anything (allocators are still growing their arenas):
its drift bounds catch a leak per request, not a slow one; the hour-long run keeps
the issue's 5%."""


@dataclass
class SoakReport:
    checks: list[invariants.Check]
    table: str
    sent: int
    seconds: float
    faults: list[fault_plan.Injected] = field(default_factory=list)

    @property
    def violations(self) -> list[invariants.Check]:
        return [c for c in self.checks if not c.ok]

    def render(self) -> str:
        lines = [f"soak: {self.sent} requests in {self.seconds:.0f} s, "
                 f"{len(self.faults)} faults", "", self.table, ""]
        for c in self.checks:
            lines.append(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
        return "\n".join(lines)


class _Sampler:
    """Samples every process of the cluster; keeps each pid's warm and last usage."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self.warm: dict[int, tuple[str, Usage, float]] = {}
        self.last: dict[int, tuple[str, Usage, float]] = {}
        self._warm_after: float | None = None
        self._born: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def warm_from(self, at: float, settle_s: float) -> None:
        """Pids seen before `at` are warm at `at`; later ones `settle_s` after birth."""
        self._warm_after = at
        self._settle_s = settle_s

    def sample(self) -> None:
        now = time.monotonic()
        for role, pid in roles(self._cluster).items():
            u = usage(pid)
            if u is None:
                continue
            born = self._born.setdefault(pid, now)
            self.last[pid] = (role, u, now)
            if pid in self.warm or self._warm_after is None or now < self._warm_after:
                continue
            if born < self._warm_after or now - born >= self._settle_s:
                self.warm[pid] = (role, u, now)

    def records(self) -> list[invariants.ProcessRecord]:
        live = set(roles(self._cluster).values())
        return [invariants.ProcessRecord(role, pid, u, self.last[pid][1],
                                         self.last[pid][2] - at)
                for pid, (role, u, at) in sorted(self.warm.items(), key=lambda x: x[1][0])
                if pid in live]

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _cluster_args(config: SoakConfig, http_port: int) -> list[str]:
    return ["--engines", str(config.engines), "--tensor-parallel-size",
            str(config.tensor_parallel), "--http-port", str(http_port),
            "--watchdog-timeout", str(config.watchdog_s), "--max-num-seqs",
            str(config.max_num_seqs), "--max-waiting-requests", str(config.max_waiting),
            "--kv-cache-memory", KV_CACHE_MEMORY, "--max-restarts", "20", "--restart-window-s",
            "60", "--log-level", "warning"]


def serving(channel: grpc.Channel, engines: int) -> bool:
    """Ready, and each engine answers a request pinned to it."""
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2)
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        stub = pb_grpc.GenerateServiceStub(channel)
        for rank in range(engines):
            stub.Generate(pb.GenerateRequest(text="ping", data_parallel_rank=rank,
                                             sampling=common_pb2.SamplingParams(max_tokens=1)),
                          timeout=5)
    except grpc.RpcError:
        return False
    return True


def wait_serving(cluster: Cluster, channel: grpc.Channel, config: SoakConfig,
                 timeout_s: float, gone: int | None = None) -> float | None:
    """Seconds until every process is back (`gone`, a killed pid, no longer among them)
    and every engine serves; None past the timeout."""
    start = time.monotonic()
    expected = {"coordinator", "frontend", *(f"engine-{i}" for i in range(config.engines))}
    while time.monotonic() - start < timeout_s:
        live = roles(cluster)
        if expected <= set(live) and gone not in live.values() and \
                serving(channel, config.engines):
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def _sweep_kv_pools(channel: grpc.Channel, config: SoakConfig) -> None:
    """Write every KV block of every engine once before the warm levels are taken: the
    pool is allocated untouched and its pages become resident as blocks are first used,
    which would read as growth. Each request has a prompt of its own, so that none
    reuses another's cached blocks."""
    stats = _engine_stats(channel)
    stub = pb_grpc.GenerateServiceStub(channel)
    # A fresh pool hands out its blocks in order: one pass over all of it touches each.
    rounds = max(int(s["num_blocks"]) * SWEEP_BLOCK_TOKENS // SWEEP_TOKENS + 1
                 for s in stats)
    requests = [pb.GenerateRequest(
        text=f"sweep {s['engine_index']} {i}", data_parallel_rank=s["engine_index"],
        sampling=common_pb2.SamplingParams(max_tokens=SWEEP_TOKENS, ignore_eos=True,
                                           temperature=0.0))
        for i in range(rounds) for s in stats]
    # No more at once than an engine lets wait (arrivals within one step all wait):
    # none is refused.
    with ThreadPoolExecutor(min(config.max_num_seqs, config.max_waiting)) as pool:
        list(pool.map(lambda r: stub.Generate(r, timeout=120), requests))


def _engine_stats(channel: grpc.Channel) -> list[dict[str, Any]]:
    reply = admin_grpc.AdminServiceStub(channel).GetEngineStats(
        admin_pb.GetEngineStatsRequest(), timeout=10)
    return [json.loads(r.result_json) if r.ok else {"engine_index": r.engine_index,
                                                     "state": r.message}
            for r in reply.results]


_SAMPLE = re.compile(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$")


def scrape(http_port: int) -> dict[str, float]:
    """The door's /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def _sum(samples: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in samples.items()
               if k.split("{")[0] == name and label in k)


def grpc_in_flight(samples: dict[str, float]) -> float:
    return (_sum(samples, "corestream:grpc_server_started_total")
            - _sum(samples, "corestream:grpc_server_handled_total"))


def run_soak(config: SoakConfig, log: Any = print) -> SoakReport:
    http_port = free_port()
    cluster = Cluster(_cluster_args(config, http_port),
                      env={"CORESTREAM_FAULT_INJECT": "raise_on_sigusr2",
                           "OMP_NUM_THREADS": "1"},
                      startup_timeout=300)
    try:
        return _soak(config, cluster, http_port, log)
    finally:
        cluster.stop()


def _soak(config: SoakConfig, cluster: Cluster, http_port: int, log: Any) -> SoakReport:
    rng = random.Random(config.seed)
    t0 = time.monotonic()
    channel = grpc.insecure_channel(cluster.address)
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="soak",
                         max_retries=0)
    model = pb_grpc.GenerateServiceStub(channel).GetModelInfo(
        pb.GetModelInfoRequest(), timeout=30).model
    clients = Clients(pb_grpc.GenerateServiceStub(channel), chat_grpc.ChatServiceStub(channel),
                      http, model, config.hang_s)
    if wait_serving(cluster, channel, config, config.heal_timeout_s) is None:
        raise RuntimeError("the cluster did not serve:\n" + cluster.output())
    sampler = _Sampler(cluster)
    sampler.start()
    plan = fault_plan.plan(random.Random(config.seed + 1), config.duration_s,
                           config.engines, config.every_kind_once, config.mean_fault_gap_s)
    log(f"soak: seed {config.seed}, {config.duration_s:g} s at {config.rate:g} req/s, "
        f"{len(plan)} faults planned: " + ", ".join(f"{f.kind}@{f.at_s:.0f}s" for f in plan))

    outcomes: list[Outcome] = []
    futures: list[Future[Outcome]] = []
    injected: list[fault_plan.Injected] = []
    heal_s: dict[int, float | None] = {}
    pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="soak-client")
    burst_pool = ThreadPoolExecutor(config.burst, thread_name_prefix="soak-burst")
    index = 0

    def warm_up() -> None:
        nonlocal index
        _sweep_kv_pools(channel, config)
        specs = []
        end = time.monotonic() + config.warm_s
        while time.monotonic() < end:
            spec = draw(rng, index)
            index += 1
            specs.append(spec)
            outcomes.append(send(spec, clients))
        sampler.warm_from(time.monotonic(), settle_s=config.warm_s)

    def faults() -> None:
        start = time.monotonic()
        for i, fault in enumerate(plan):
            delay = start + fault.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if fault.kind == "admission_burst":
                started = time.monotonic()
                burst = [burst_spec(j) for j in range(config.burst)]
                futures.extend(burst_pool.submit(send, s, clients) for s in burst)
                injected.append(fault_plan.Injected(fault, started, time.monotonic(),
                                                    f"{config.burst} streams at once"))
            else:
                injected.append(fault_plan.inject(fault, cluster, config.freeze_s))
            log(f"  {time.monotonic() - t0:6.1f} s  {fault.kind} -> {injected[-1].target}"
                f"{' (' + injected[-1].error + ')' if injected[-1].error else ''}")
            heal_s[i] = wait_serving(cluster, channel, config, config.heal_timeout_s,
                                     gone=injected[-1].killed)
            log(f"  {time.monotonic() - t0:6.1f} s  serving again "
                f"({heal_s[i] if heal_s[i] is None else round(heal_s[i], 1)} s)")

    burst_index = [1 << 20]

    def burst_spec(j: int) -> RequestSpec:
        burst_index[0] += 1
        return RequestSpec(burst_index[0], "grpc_stream", "Once upon a time", 64, True, 1,
                           False, (), "", False, None, None)

    warm_up()
    log(f"  {time.monotonic() - t0:6.1f} s  warm: {len(outcomes)} requests")
    fault_thread = threading.Thread(target=faults, name="soak-faults", daemon=True)
    traffic_start = time.monotonic()
    fault_thread.start()
    next_at = traffic_start
    while True:
        next_at += rng.expovariate(config.rate)
        if next_at - traffic_start >= config.duration_s:
            break
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(pool.submit(send, draw(rng, index), clients))
        index += 1
    fault_thread.join()
    outcomes.extend(f.result() for f in futures)
    pool.shutdown()
    burst_pool.shutdown()
    log(f"  {time.monotonic() - t0:6.1f} s  traffic done: {len(outcomes)} requests")

    healed = wait_serving(cluster, channel, config, config.heal_timeout_s)
    time.sleep(config.quiet_s)
    sampler.sample()
    sampler.stop()
    stats = _engine_stats(channel)
    in_flight = grpc_in_flight(scrape(http_port))
    references = _references(outcomes, clients)
    expected, measured = _metrics_phase(clients, http_port, rng)

    checks = [
        invariants.every_kind(injected, fault_plan.KINDS if config.every_kind_once else ()),
        invariants.faults_healed(injected, heal_s),
        invariants.Check("serving at the end", healed is not None,
                         f"after {healed if healed is None else round(healed, 1)} s"),
        invariants.no_hang(outcomes, slack_s=2.0),
        invariants.codes_allowed(outcomes, injected, config.fault_window_s),
        invariants.retry_hints(outcomes),
        invariants.texts_match(outcomes, references),
        invariants.engines_drained(stats),
        invariants.frontend_drained(in_flight),
        invariants.resources_flat(sampler.records(), config.rss_drift, config.min_judged_s,
                                  config.fd_slack, config.thread_slack),
        invariants.metrics_agree(expected, measured),
    ]
    channel.close()
    return SoakReport(checks, invariants.codes_table(outcomes), len(outcomes),
                      time.monotonic() - t0, injected)


def _references(outcomes: list[Outcome], clients: Clients) -> dict[tuple, str | None]:
    """A fault-free answer for each greedy request that completed, sent after the run."""
    specs: dict[tuple, RequestSpec] = {}
    for o in outcomes:
        key = o.spec.reference_key
        if o.code == "OK" and key is not None:
            specs.setdefault(key, o.spec.reference_spec())
    references: dict[tuple, str | None] = {}
    with ThreadPoolExecutor(4) as pool:
        for key, outcome in zip(specs, pool.map(lambda s: send(s, clients), specs.values()),
                                strict=True):
            references[key] = outcome.texts[0] if outcome.code == "OK" else None
    return references


def _metrics_phase(clients: Clients, http_port: int,
                   rng: random.Random) -> tuple[dict[str, float], dict[str, float]]:
    """A fault-free mix sent between two scrapes: what the client counted, and what
    the frontend's counters moved by."""
    before = scrape(http_port)
    specs = [draw(rng, (1 << 24) + i) for i in range(40)]
    specs = [RequestSpec(s.index, s.door, s.prompt, s.max_tokens, s.greedy, s.n, s.logprobs,
                         s.stop, s.constraint, s.tools, None, None, s.invalid or i % 8 == 0)
             for i, s in enumerate(specs)]
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda s: send(s, clients), specs))
    time.sleep(0.5)  # the last requests' counters move as their handlers return
    after = scrape(http_port)
    codes = Counter(o.code for o in outcomes)
    expected = {"samples finished": float(sum(o.spec.n for o in outcomes if o.code == "OK"))}
    expected.update({f"rejected {code}": float(n) for code, n in codes.items() if code != "OK"})
    measured = {"samples finished": _sum(after, "corestream:request_success_total")
                - _sum(before, "corestream:request_success_total")}
    for key in after:
        if key.startswith("corestream:requests_rejected_total"):
            code = re.search(r'code="([A-Z_]+)"', key)
            delta = after[key] - before.get(key, 0.0)
            if code and delta:
                name = f"rejected {code.group(1)}"
                measured[name] = measured.get(name, 0.0) + delta
    return expected, measured
