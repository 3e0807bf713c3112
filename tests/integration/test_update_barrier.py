"""Two DP engines switch weights together under load (`corestream serve --engines 2`):

- keep: with requests frozen across an update, every request's tokens run on the old
  version and then the new, never back, and a request that saw both reports both (its
  first and last versions);
- wait: the pause answers once the running requests finished, so an update sent right
  after it lands between requests: each running one saw only the old version, and the
  requests that arrived while paused see only the new one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import generate_service_pb2 as pb

from tests.integration.rl_cluster import Setup

pytestmark = pytest.mark.timeout(300)

NUM_PER_ENGINE = 8
# The test model's context is 128 tokens: 4 of prompt, 120 generated, a step each; a
# keep pause sent at the first token lands long before the last.
MAX_TOKENS = 120
# The tiny model makes 120 tokens in tens of milliseconds, and on a loaded machine a
# request's last token could come before the last stream's first: a floor on each step
# (1.2 s a request) keeps requests running on both engines when a pause comes.
STEP_FLOOR_MS = 10
SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("barrier"),
              env={"CORESTREAM_FAULT_INJECT": f"slow_steps:{STEP_FLOOR_MS}"})
    try:
        yield s
    finally:
        s.close()


class Streams:
    """Greedy streams pinned half to each engine, with the version of every token."""

    def __init__(self, setup: Setup, first_prompt_token: int) -> None:
        self.versions: dict[int, list[str]] = {}
        self.first_token = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(setup, i, first_prompt_token))
                         for i in range(2 * NUM_PER_ENGINE)]
        for thread in self._threads:
            thread.start()

    def _run(self, setup: Setup, i: int, first: int) -> None:
        versions = self.versions.setdefault(i, [])
        for chunk in setup.generate.GenerateStream(pb.GenerateStreamRequest(
                token_ids=pb.TokenIds(ids=[first + i, 7, 9, 11]),
                data_parallel_rank=i % 2, sampling=SAMPLING), timeout=120):
            versions += [chunk.weight_version] * len(chunk.token_ids)
            if versions:
                self.first_token.set()

    def join(self) -> dict[int, list[str]]:
        for thread in self._threads:
            thread.join(120)
        assert all(len(v) == MAX_TOKENS for v in self.versions.values()), self.versions
        return self.versions


def _frozen_streams(setup: Setup, first_prompt_token: int
                    ) -> tuple[Streams, admin_pb.PauseSchedulingResponse]:
    """Streams frozen by a keep pause while every engine still runs some of them.

    On a loaded machine one engine's streams may all end before the other's first token
    comes back, so the pause may find an engine idle; then the streams finish and new ones
    start. The keep pause's own answer (returned) says what each engine held.
    """
    for _ in range(5):
        streams = Streams(setup, first_prompt_token)
        while not (len(streams.versions) == 2 * NUM_PER_ENGINE
                   and all(streams.versions.values())):
            time.sleep(0.01)
        kept = setup.admin.PauseScheduling(admin_pb.PauseSchedulingRequest(
            mode=admin_pb.PAUSE_MODE_KEEP), timeout=30)
        assert all(r.ok for r in kept.results), kept
        if all(json.loads(r.result_json)["num_running"] > 0 for r in kept.results):
            return streams, kept
        setup.admin.ResumeScheduling(admin_pb.ResumeSchedulingRequest(), timeout=20)
        streams.join()
    raise AssertionError("no keep pause found requests running on every engine in 5 tries")


def _switches(versions: list[str]) -> int:
    return sum(a != b for a, b in zip(versions, versions[1:], strict=False))


def _num_unfinished(setup: Setup) -> list[int]:
    stats = setup.admin.GetEngineStats(admin_pb.GetEngineStatsRequest(), timeout=20)
    return [json.loads(r.result_json)["num_running"] + json.loads(r.result_json)["num_waiting"]
            for r in stats.results]


def test_kept_requests_switch_once_and_report_both(setup: Setup) -> None:
    unary: list[pb.GenerateResponse] = []
    threads = [threading.Thread(target=lambda e=engine: unary.append(setup.generate.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4, 5, 6]), data_parallel_rank=e,
                           sampling=SAMPLING), timeout=120))) for engine in setup.engines]
    for thread in threads:
        thread.start()
    streams, kept = _frozen_streams(setup, 20)
    # Every request is frozen mid-generation or waits to start; a stream still on its
    # way to the frontend may not be counted.
    assert all(n <= NUM_PER_ENGINE + 1 for n in _num_unfinished(setup))
    folder, _ = setup.perturb("v1")
    reply = setup.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
        path=str(folder), weight_version="v1"), timeout=120)
    assert reply.ok, reply
    setup.admin.ResumeScheduling(admin_pb.ResumeSchedulingRequest(), timeout=20)
    versions = streams.join()
    for thread in threads:
        thread.join(120)
    # Versions never go back; a request that finished before the pause saw only v0, one
    # queued behind it only v1.
    spans = [(seen[0], seen[-1]) for seen in versions.values() if _switches(seen) <= 1]
    assert len(spans) == len(versions), versions
    # Frozen across the update: each reports the version it started on and the new one.
    spans += [(r.completions[0].first_weight_version, r.completions[0].weight_version)
              for r in unary]
    assert set(spans) <= {("v0", "v0"), ("v0", "v1"), ("v1", "v1")}, spans
    # Exactly the requests the keep pause froze mid-generation saw both versions.
    frozen = sum(json.loads(r.result_json)["num_running"] for r in kept.results)
    assert spans.count(("v0", "v1")) == frozen, (spans, kept)


def test_wait_pause_drains_then_late_requests_see_only_the_new_version(setup: Setup) -> None:
    before = setup.admin.GetEngineStats(admin_pb.GetEngineStatsRequest(), timeout=20)
    old = {json.loads(r.result_json)["weight_version"] for r in before.results}
    assert len(old) == 1
    streams = Streams(setup, 40)
    deadline = time.monotonic() + 60
    # Every stream must be running when the pause comes (one still on its way would
    # queue behind it and run on the new weights).
    while not (len(streams.versions) == 2 * NUM_PER_ENGINE and all(streams.versions.values())):
        assert time.monotonic() < deadline, streams.versions
        time.sleep(0.01)
    paused = setup.admin.PauseScheduling(admin_pb.PauseSchedulingRequest(
        mode=admin_pb.PAUSE_MODE_WAIT, timeout_s=120), timeout=130)
    assert all(r.ok for r in paused.results), paused
    # It answered once nothing ran: the streams had their last tokens.
    assert [json.loads(r.result_json)["num_running"] for r in paused.results] == [0, 0]
    late = Streams(setup, 60)
    while sum(_num_unfinished(setup)) < 2 * NUM_PER_ENGINE:
        time.sleep(0.02)  # every late request queued behind the pause
    folder, _ = setup.perturb("v2")
    reply = setup.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
        path=str(folder), weight_version="v2"), timeout=120)
    assert reply.ok, reply
    setup.admin.ResumeScheduling(admin_pb.ResumeSchedulingRequest(), timeout=20)
    assert all(set(seen) == old for seen in streams.join().values())
    assert all(set(seen) == {"v2"} for seen in late.join().values())


def test_vllm_pause_routes_on_the_http_door(setup: Setup) -> None:
    base = f"http://127.0.0.1:{setup.http_port}"
    for params, field in (({"mode": "sideways"}, "mode"),
                          ({"mode": "wait", "timeout_s": "-1"}, "timeout_s"),
                          ({"mode": "keep", "clear_cache": "maybe"}, "clear_cache")):
        refused = httpx.post(base + "/pause", params=params, timeout=30)
        assert refused.status_code == 400 and field in refused.text, refused.text
    assert httpx.get(base + "/is_paused", timeout=30).json() == {"is_paused": False}
    streams = Streams(setup, 80)
    while not (len(streams.versions) == 2 * NUM_PER_ENGINE and all(streams.versions.values())):
        time.sleep(0.01)
    paused = httpx.post(base + "/pause", params={"mode": "wait"}, timeout=130)
    assert paused.status_code == 200, paused.text
    engines = paused.json()["engines"]
    assert [e["num_running"] for e in engines] == [0, 0]
    # As vLLM's, the route clears the prefix cache by default: the streams' blocks go.
    assert all(e["num_cached_blocks_dropped"] > 0 for e in engines), engines
    streams.join()
    assert httpx.get(base + "/is_paused", timeout=30).json() == {"is_paused": True}
    assert httpx.post(base + "/resume", timeout=30).json()["paused"] is False
    assert httpx.get(base + "/is_paused", timeout=30).json() == {"is_paused": False}


def test_a_wait_pause_past_its_timeout_says_so_and_stays_paused(setup: Setup) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        setup.admin.PauseScheduling(admin_pb.PauseSchedulingRequest(
            mode=admin_pb.PAUSE_MODE_WAIT, timeout_s=-1), timeout=30)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_s" in (refused.value.details() or "")
    streams, _ = _frozen_streams(setup, 100)
    try:
        # Each engine holds frozen requests with ~100 steps to go: the wait pause that
        # takes over from the keep pause cannot see them finish within a millisecond.
        paused = setup.admin.PauseScheduling(admin_pb.PauseSchedulingRequest(
            mode=admin_pb.PAUSE_MODE_WAIT, timeout_s=0.001), timeout=30)
        assert all(r.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
                   and "within 0.001 s" in r.message for r in paused.results), paused
        assert setup.admin.IsPaused(admin_pb.IsPausedRequest(), timeout=30).is_paused
    finally:
        setup.admin.ResumeScheduling(admin_pb.ResumeSchedulingRequest(), timeout=20)
    streams.join()
