"""An MoE model split over two engine processes (expert parallel, gloo on 127.0.0.1),
stepping in lockstep waves started through the coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coord_pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coord_grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from services.common.config import LEFT_OUT_EXIT
from tests.integration.cluster import REPO, Cluster, descendants
from tests.unit.engine.fakes import SessionClient

pytestmark = pytest.mark.timeout(400)

PROMPTS = {"a": [5, 17, 42, 99, 7, 3, 250, 11], "b": [1, 2, 3], "c": list(range(40, 70))}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(moe_checkpoint: Path) -> dict[str, list[int]]:
    return one_process(moe_checkpoint, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(moe_checkpoint: Path) -> Iterator[Cluster]:
    c = Cluster(["--model", str(moe_checkpoint), "--engines", "2", "--wave-check-interval", "4",
                 "--data-parallel-timeout", "15", "--kv-cache-memory", "16MiB",
                 "--prefill-schedule-interval", "4", "--iteration-details"],
                env={"OMP_NUM_THREADS": "1"})
    yield c
    c.stop()


def generate(stub: pb_grpc.GenerateServiceStub, ids: list[int], rank: int,
             max_tokens: int = MAX_TOKENS) -> list[int]:
    reply = stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), data_parallel_rank=rank,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True)), timeout=120)
    return list(reply.completions[0].token_ids)


def stats(address: str) -> dict[int, dict[str, Any]]:
    with grpc.insecure_channel(address) as channel:
        reply = admin_grpc.AdminServiceStub(channel).GetEngineStats(
            admin_pb.GetEngineStatsRequest(), timeout=20)
    assert all(r.ok for r in reply.results), reply
    return {r.engine_index: json.loads(r.result_json) for r in reply.results}


def wait_idle(address: str, timeout: float = 30) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(address)
        if not any(e["wave_running"] for e in s.values()):
            return s
        assert time.monotonic() < deadline, f"the wave did not end: {s}"
        time.sleep(0.2)


def one_process(moe_checkpoint: Path, prompts: dict[str, list[int]],
                tokens: int) -> dict[str, list[int]]:
    """Greedy tokens of the whole model in this process: what every rank must give."""
    from tests.unit.engine.runner_driver import generate as run_model
    from tests.unit.engine.runner_driver import make_runner

    return run_model(make_runner(moe_checkpoint, max_model_len=256), prompts, tokens)


def group_of_two(moe_checkpoint: Path, collective_timeout_s: int,
                 fault: str | None = None, *extra: str) -> Cluster:
    """Two expert-parallel engines whose collectives give up after the timeout."""
    env = {"OMP_NUM_THREADS": "1", **({"CORESTREAM_FAULT_INJECT": fault} if fault else {})}
    return Cluster(["--model", str(moe_checkpoint), "--engines", "2", "--wave-check-interval",
                    "4", "--data-parallel-timeout", str(collective_timeout_s),
                    "--kv-cache-memory", "16MiB", *extra], env=env)


def greedy_calls(stub: pb_grpc.GenerateServiceStub, prompts: dict[str, list[int]],
                 tokens: int) -> dict[str, list[int]]:
    """Every prompt at once, prompt i on rank i % 2; their tokens."""
    calls = {rid: stub.Generate.future(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), data_parallel_rank=i % 2,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens,
                                           ignore_eos=True)), timeout=120)
        for i, (rid, ids) in enumerate(prompts.items())}
    return {rid: list(call.result().completions[0].token_ids) for rid, call in calls.items()}


def fault_epochs(channel: grpc.Channel) -> list[int | None]:
    results = admin_grpc.AdminServiceStub(channel).GetFaultStatus(
        admin_pb.GetFaultStatusRequest(), timeout=20).results
    return [json.loads(r.result_json).get("epoch") if r.ok else None for r in results]


def test_two_ranks_equal_one_process_and_idle_ranks_run_dummy_steps(
        cluster: Cluster, reference: dict[str, list[int]]) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).num_engines == 2
        # Everything on rank 0: rank 1 must run dummy batches to keep up.
        calls = {rid: stub.Generate.future(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), data_parallel_rank=0,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True)), timeout=120)
            for rid, ids in PROMPTS.items()}
        got = {rid: list(call.result().completions[0].token_ids) for rid, call in calls.items()}
        assert got == reference
        idle = wait_idle(cluster.address)
        assert idle[1]["dummy_steps"] > 0 and idle[0]["wave"] == idle[1]["wave"] >= 1
        # Idle means idle: no rank keeps stepping.
        time.sleep(1.0)
        again = stats(cluster.address)
        assert [again[r]["step_counter"] for r in (0, 1)] == \
            [idle[r]["step_counter"] for r in (0, 1)]
        # A request on rank 1 starts the next wave on both ranks.
        assert generate(stub, PROMPTS["b"], rank=1) == reference["b"]
        after = wait_idle(cluster.address)
        assert after[0]["wave"] == after[1]["wave"] > idle[0]["wave"]
        assert after[0]["dummy_steps"] > idle[0]["dummy_steps"]
    # The coordinator sees the wave state in the engines' load reports.
    deadline = time.monotonic() + 10
    while True:
        with grpc.insecure_channel(cluster.coordinator_address) as channel:
            engines = coord_grpc.CoordinatorServiceStub(channel).ListEngines(
                coord_pb.ListEnginesRequest(), timeout=10).engines
        if sorted((e.wave, e.wave_running) for e in engines) == \
                [(after[0]["wave"], False)] * 2:
            break
        assert time.monotonic() < deadline, engines
        time.sleep(0.2)


def test_throttled_ranks_prefill_in_the_same_wave_steps(cluster: Cluster) -> None:
    """--prefill-schedule-interval 4: 16 streams on each rank arriving in bursts; every
    step of either rank that prefilled is step 0, 4, 8, ... of its wave, as the
    iteration details (a Session on each engine that asked for them) say."""
    sessions = [SessionClient(grpc.insecure_channel(address), iteration_details=True)
                for address in cluster.engine_addresses]
    details: list[list[Any]] = [[], []]

    def read(session: SessionClient) -> None:
        for msg in session.responses:
            if msg.HasField("iteration_details"):
                details[msg.engine_index].append(msg.iteration_details)

    readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in sessions]
    for reader in readers:
        reader.start()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        # A long request keeps the wave running, so that the bursts land mid-wave.
        calls = [stub.Generate.future(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPTS["a"]), data_parallel_rank=0,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=150,
                                               ignore_eos=True)), timeout=120)]
        for burst in range(4):
            calls += [stub.Generate.future(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[burst + 1, i + 5, 9]), data_parallel_rank=i % 2,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True)), timeout=120)
                for i in range(8)]
            time.sleep(0.15)  # the next burst lands mid-wave
        for call in calls[1:]:
            assert len(call.result().completions[0].token_ids) == MAX_TOKENS
        calls[0].result()
    idle = wait_idle(cluster.address)
    for session in sessions:
        session.close()
    for reader in readers:
        reader.join(30)
    prefills = [(rank, d.wave, d.wave_step) for rank in (0, 1) for d in details[rank]
                if d.num_prefill_requests]
    assert {rank for rank, _, _ in prefills} == {0, 1}, prefills
    assert all(step % 4 == 0 for _, _, step in prefills), prefills
    assert any(step > 0 for _, _, step in prefills), prefills
    assert all(d.forward_seconds > 0 for rank in details for d in rank)
    # --iteration-details: each engine's stats carry its latest steps.
    for rank in (0, 1):
        summary = idle[rank]["iteration_details"]
        assert summary["steps"] >= len(details[rank]) and summary["recent"]


def test_the_first_rank_dying_mid_wave_ends_the_others_streams(cluster: Cluster) -> None:
    """Rank 0 hosts the group's rendezvous store: without it the others cannot re-form
    (a later rank is replaced alone: see the tests below). serve restarts the whole
    group, and rank 1's stream ends UNAVAILABLE."""
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        stream = stub.GenerateStream(pb.GenerateStreamRequest(
            token_ids=pb.TokenIds(ids=PROMPTS["a"]), data_parallel_rank=1,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=200,
                                               ignore_eos=True)), timeout=120)
        next(stream)
        os.kill(cluster.engine_pid(0), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        elapsed = time.monotonic() - killed
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "engine" in (err.value.details() or "")
    assert elapsed < 20, elapsed  # within the group's collective timeout (15 s) + margin
    print(f"rank 0 killed mid-wave: rank 1's stream ended UNAVAILABLE after {elapsed:.2f} s")


def test_expert_parallel_engines_of_two_tensor_parallel_ranks_each(
        moe_checkpoint: Path, reference: dict[str, list[int]]) -> None:
    """Each expert's weights split over 2 TP ranks inside each of 2 engines that split the
    experts: 4 processes, each TP rank in the expert-parallel group of its own rank."""
    c = Cluster(["--model", str(moe_checkpoint), "--engines", "2", "--wave-check-interval", "4",
                 "--data-parallel-timeout", "30", "--kv-cache-memory", "16MiB",
                 "--tensor-parallel-size", "2"], env={"OMP_NUM_THREADS": "1"})
    try:
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            # Rank 0 alone: rank 1's engine (both its TP ranks) runs dummy batches.
            assert generate(stub, PROMPTS["a"], rank=0) == reference["a"]
            calls = {rid: stub.Generate.future(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids), data_parallel_rank=i % 2,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True)), timeout=120)
                for i, (rid, ids) in enumerate(PROMPTS.items())}
            got = {rid: list(call.result().completions[0].token_ids)
                   for rid, call in calls.items()}
            assert got == reference
    finally:
        c.stop()


def test_a_rank_whose_step_fails_pauses_with_its_peer_and_both_resume(
        moe_checkpoint: Path) -> None:
    """Rank 1's forward raises once mid-wave (the fault injection); rank 0 waits for it
    at the experts' collective until the group's timeout (5 s) and fails too. Neither
    dies: both pause (PAUSED_FAULT), re-form the group under epoch 1 and resume, and
    every stream of both ranks ends with the tokens of the whole model in one process.
    The engine processes are the same ones (nothing restarted or reloaded)."""
    prompts = {f"p{i}": [3 + i, 40 + 2 * i, 7, 90 - i] for i in range(16)}
    tokens = 40  # so that every request is in before the fault
    reference = one_process(moe_checkpoint, prompts, tokens)
    c = group_of_two(moe_checkpoint, 5, fault="raise_once_after_steps:20@1")
    try:
        pids = [c.engine_pid(r) for r in (0, 1)]
        with grpc.insecure_channel(c.address) as channel:
            assert greedy_calls(pb_grpc.GenerateServiceStub(channel), prompts, tokens) == \
                reference
        after = stats(c.address)
        for rank in (0, 1):
            fault = after[rank]["fault"]
            assert fault["faults"] == 1 and fault["epoch"] == 1, fault
            assert after[rank]["state"] == "RUNNING"
        assert "injected fault" in after[1]["fault"]["last_fault"]["reason"]
        with grpc.insecure_channel(c.address) as channel:
            assert fault_epochs(channel) == [1, 1]
        assert [c.engine_pid(r) for r in (0, 1)] == pids
        print(*[line for line in c.output().splitlines() if "recovered under epoch" in line],
              sep="\n")
        # The re-formed group serves on.
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            assert generate(stub, prompts["p1"], rank=1, max_tokens=tokens) == reference["p1"]
    finally:
        c.stop()


def kill_rank_1_under_streams(
        c: Cluster, stub: pb_grpc.GenerateServiceStub, prompts: dict[str, list[int]],
        tokens: int, victim: Callable[[], int] | None = None,
) -> tuple[dict[str, list[int]], dict[str, tuple[int, Any, str]], float]:
    """Stream every prompt (prompt i on rank i % 2), SIGKILL rank 1 (or the `victim`
    process) once all have started, and read them to their end: (tokens by prompt,
    (rank, code, details) of those that failed, seconds from the kill until the last
    ended)."""
    streams = {rid: stub.GenerateStream(pb.GenerateStreamRequest(
        token_ids=pb.TokenIds(ids=ids), data_parallel_rank=i % 2,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens,
                                           ignore_eos=True)), timeout=180)
        for i, (rid, ids) in enumerate(prompts.items())}
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, stream in streams.items():  # every stream has started
        got[rid] += next(stream).token_ids
    os.kill(victim() if victim is not None else c.engine_pid(1), signal.SIGKILL)
    killed = time.monotonic()
    errors = {}
    for i, (rid, stream) in enumerate(streams.items()):
        try:
            for chunk in stream:
                got[rid] += chunk.token_ids
        except grpc.RpcError as e:
            errors[rid] = (i % 2, e.code(), e.details() or "")
    return got, errors, time.monotonic() - killed


def rank_1_replaced(c: Cluster, prompts: dict[str, list[int]], tokens: int,
                    reference: dict[str, list[int]], pids: Callable[[], tuple[int, ...]],
                    victim: Callable[[], int] | None = None) -> tuple[float, float]:
    """Kill rank 1 (or `victim`) under streams on both ranks and check that rank 0's
    streams complete with the reference tokens, rank 1's end UNAVAILABLE naming its
    engine, rank 0's processes (`pids`) are the same, and both ranks serve once the
    group re-formed with rank 1's replacement: (seconds from the kill until rank 0's
    streams ended, until both ranks served)."""
    survivors = pids()
    with grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        got, errors, resumed = kill_rank_1_under_streams(c, stub, prompts, tokens, victim)
        killed = time.monotonic() - resumed
        on_rank0 = [rid for i, rid in enumerate(prompts) if i % 2 == 0]
        assert {rid: got[rid] for rid in on_rank0} == {rid: reference[rid] for rid in on_rank0}
        assert sorted(errors) == [rid for rid in prompts if rid not in on_rank0], errors
        for rank, code, details in errors.values():
            assert rank == 1 and code == grpc.StatusCode.UNAVAILABLE, details
            assert "engine" in (details or ""), details
        assert pids() == survivors
        deadline = time.monotonic() + 120
        while (epochs := fault_epochs(channel)) != [1, 1]:
            assert time.monotonic() < deadline, epochs
            time.sleep(0.5)
        serving = time.monotonic() - killed
        for rank in (0, 1):
            assert generate(stub, prompts["p0"], rank=rank, max_tokens=tokens) == \
                reference["p0"]
    return resumed, serving


def test_a_killed_rank_is_replaced_alone_and_its_peer_resumes(moe_checkpoint: Path) -> None:
    """SIGKILL rank 1 with streams running on both ranks. Rank 0 pauses (its collective
    fails), keeps its requests, and re-forms the group with the replacement serve starts
    for rank 1; rank 0's streams then complete with the tokens of an uninterrupted run,
    rank 1's end UNAVAILABLE naming that engine, rank 0 is the same process (never
    reloaded), and both serve new requests."""
    tokens = 60
    prompts = {f"p{i}": [5 + i, 60 - i, 11, 3 * i + 1] for i in range(8)}
    reference = one_process(moe_checkpoint, prompts, tokens)
    c = group_of_two(moe_checkpoint, 15)
    try:
        resumed, serving = rank_1_replaced(c, prompts, tokens, reference,
                                           lambda: (c.engine_pid(0),))
        print(f"rank 1 killed: rank 0's streams completed {resumed:.1f} s later, both ranks "
              f"serving after {serving:.1f} s")
    finally:
        c.stop()


def tensor_parallel_worker_pid(c: Cluster, engine_index: int) -> int:
    """The pid of engine `engine_index`'s tensor-parallel worker (of a TP=2 engine)."""
    workers = [pid for pid in descendants(c.engine_pid(engine_index))
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    return workers[0]


def test_a_killed_tensor_parallel_worker_takes_only_its_engine_and_the_peer_resumes(
        moe_checkpoint: Path) -> None:
    """Two expert-parallel engines of two TP ranks each: SIGKILL rank 1's worker with
    streams on both ranks. Rank 1 dies (it lost half its model); serve replaces it.
    Rank 0 and its worker each lose a peer of their expert-parallel group, pause,
    re-form their own TP group (its ranks may have failed at different collectives) and
    each its group with the replacement's rank, and resume: rank 0's streams complete
    with the tokens of an uninterrupted run, rank 0 and its worker are the same
    processes, and both ranks serve new requests."""
    tokens = 60
    prompts = {f"p{i}": [4 + i, 70 - i, 17, 2 * i + 5] for i in range(8)}
    reference = one_process(moe_checkpoint, prompts, tokens)
    c = group_of_two(moe_checkpoint, 10, None, "--tensor-parallel-size", "2")
    try:
        resumed, serving = rank_1_replaced(
            c, prompts, tokens, reference,
            lambda: (c.engine_pid(0), tensor_parallel_worker_pid(c, 0)),
            lambda: tensor_parallel_worker_pid(c, 1))
        print(f"rank 1's TP worker killed: rank 0's streams completed {resumed:.1f} s "
              f"later, both ranks serving after {serving:.1f} s")
    finally:
        c.stop()


def test_tensor_parallel_engines_go_on_as_a_smaller_group(moe_checkpoint: Path) -> None:
    """As above with restarts off: no replacement comes. Past its recovery timeout rank
    0's group goes on without rank 1, its worker's group follows that decision, and each
    of rank 0's TP ranks loads its slice of the experts rank 1 held: rank 0's streams
    complete with the tokens of the whole model and it serves alone."""
    tokens = 60
    prompts = {f"p{i}": [6 + i, 66 - i, 19, 2 * i + 7] for i in range(8)}
    reference = one_process(moe_checkpoint, prompts, tokens)
    c = group_of_two(moe_checkpoint, 5, None, "--tensor-parallel-size", "2",
                     "--max-restarts", "0", "--engine-recovery-timeout-s", "6")
    try:
        survivors = (c.engine_pid(0), tensor_parallel_worker_pid(c, 0))
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            got, errors, resumed = kill_rank_1_under_streams(
                c, stub, prompts, tokens, lambda: tensor_parallel_worker_pid(c, 1))
            on_rank0 = [rid for i, rid in enumerate(prompts) if i % 2 == 0]
            assert {rid: got[rid] for rid in on_rank0} == {rid: reference[rid]
                                                           for rid in on_rank0}
            assert set(errors) == set(prompts) - set(on_rank0), errors
            assert resumed >= 6, "rank 0 went on before its recovery timeout"
            status = json.loads(admin_grpc.AdminServiceStub(channel).GetFaultStatus(
                admin_pb.GetFaultStatusRequest(engine_index=0), timeout=20
            ).results[0].result_json)
            assert status["state"] == "RUNNING" and status["group_size"] == 1, status
            assert (c.engine_pid(0), tensor_parallel_worker_pid(c, 0)) == survivors
            assert generate(stub, prompts["p1"], rank=0, max_tokens=tokens) == reference["p1"]
        # Both TP ranks of rank 0 re-formed their expert-parallel groups as one rank.
        assert c.output().count("re-formed without ranks [1]") == 2, c.output()
        print(f"rank 1's TP worker killed, never replaced: rank 0 serving alone "
              f"{resumed:.1f} s later")
    finally:
        c.stop()


def test_a_rank_never_replaced_leaves_its_peer_serving_as_a_smaller_group(
        moe_checkpoint: Path) -> None:
    """SIGKILL rank 1 with restarts off: no replacement comes. Rank 0 pauses, waits
    out --engine-recovery-timeout-s, then re-forms the group without rank 1 (a group of
    one), loads the experts rank 1 held from the checkpoint and keeps everything else:
    its streams complete with the tokens of the whole model, it is the same process,
    and new requests are served by it."""
    tokens = 60
    prompts = {f"p{i}": [7 + i, 50 - i, 13, 2 * i + 3] for i in range(8)}
    reference = one_process(moe_checkpoint, prompts, tokens)
    c = group_of_two(moe_checkpoint, 5, None, "--max-restarts", "0",
                     "--engine-recovery-timeout-s", "6")
    try:
        survivor = c.engine_pid(0)
        rank1_argv = Path(f"/proc/{c.engine_pid(1)}/cmdline").read_bytes().split(b"\0")[:-1]
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            got, errors, resumed = kill_rank_1_under_streams(c, stub, prompts, tokens)
            on_rank0 = [rid for i, rid in enumerate(prompts) if i % 2 == 0]
            assert {rid: got[rid] for rid in on_rank0} == {rid: reference[rid]
                                                           for rid in on_rank0}
            assert set(errors) == set(prompts) - set(on_rank0), errors
            assert {code for _, code, _ in errors.values()} == {grpc.StatusCode.UNAVAILABLE}
            assert resumed >= 6, "rank 0 went on before its recovery timeout"
            status = json.loads(admin_grpc.AdminServiceStub(channel).GetFaultStatus(
                admin_pb.GetFaultStatusRequest(engine_index=0), timeout=20
            ).results[0].result_json)
            assert status["state"] == "RUNNING" and status["group_size"] == 1, status
            assert c.engine_pid(0) == survivor
            reply = stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompts["p1"]),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens,
                                                   ignore_eos=True)), timeout=120)
            assert list(reply.completions[0].token_ids) == reference["p1"]
        output = c.output()
        assert "experts 0..3 of 4 loaded" in output
        assert "is not replaced" in output
        # Rank 1 started again by hand (as an orchestrator would): refused at once, with
        # the exit code that tells serve not to restart it.
        late = subprocess.run([a.decode() for a in rank1_argv], cwd=REPO, timeout=120,
                              capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert late.returncode == LEFT_OUT_EXIT, late.stderr[-2000:]
        assert "rank 1 was left out of the group" in late.stderr, late.stderr[-2000:]
        print(f"rank 1 killed, never replaced: rank 0 serving alone {resumed:.1f} s later")
    finally:
        c.stop()


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_frozen_rank_pauses_its_peer_which_resumes_when_it_thaws(
        moe_checkpoint: Path, tensor_parallel_size: int) -> None:
    """SIGSTOP rank 1 mid-wave: rank 0 does not hang, its collective times out (5 s) and
    it pauses, saying why; after SIGCONT rank 1's step fails too (the group it was in is
    gone), both re-form, and rank 0's stream completes with every token. With TP engines
    only rank 1's engine process is frozen: its worker, blocked on it, lives on, and each
    engine's TP group re-forms as well as the groups of both TP ranks."""
    tokens = 80
    prompt = [9, 8, 7, 6]
    reference = one_process(moe_checkpoint, {"a": prompt}, tokens)["a"]
    c = group_of_two(moe_checkpoint, 5, None, "--tensor-parallel-size",
                     str(tensor_parallel_size))
    frozen = c.engine_pid(1)
    try:
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            admin = admin_grpc.AdminServiceStub(channel)
            stream = stub.GenerateStream(pb.GenerateStreamRequest(
                token_ids=pb.TokenIds(ids=prompt), data_parallel_rank=0,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens,
                                                   ignore_eos=True)), timeout=180)
            got = list(next(stream).token_ids)
            os.kill(frozen, signal.SIGSTOP)
            deadline = time.monotonic() + 30
            while True:
                status = json.loads(admin.GetFaultStatus(admin_pb.GetFaultStatusRequest(
                    engine_index=0), timeout=10).results[0].result_json)
                if status["state"] == "PAUSED_FAULT":
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.2)
            assert status["last_fault"]["reason"], status
            os.kill(frozen, signal.SIGCONT)
            for chunk in stream:
                got += chunk.token_ids
            assert got == reference
            assert c.engine_pid(1) == frozen
            assert fault_epochs(channel) == [1, 1]
    finally:
        os.kill(frozen, signal.SIGCONT)
        c.stop()
