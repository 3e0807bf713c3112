"""Iteration details and prefill throttling (#40): what they cost, what they change.

    .venv/bin/python benchmarks/iteration_details.py [--steps 3000] [--rounds 5]
                                                     [--skip-throttle] [--requests 48]

cost: one EngineCore in process on a runner that computes nothing (each step returns the
next token at once), so that the busy loop's own time per step is all there is, and any
cost of recording shows at its largest. Three ways, alternated over `--rounds`: details
off (the default), on by the engine's flag, and on because a Session asked (each step's
details are then also routed to it). Prints the median microseconds per step and each
way's difference from off.

throttle: `corestream serve --engines 2` on a random Mixtral (experts split over the two
ranks, lockstep waves), `--requests` greedy streams (prompts of 16-96 tokens, 32 new
tokens each) arriving at random on both ranks, with `--prefill-schedule-interval` 1 and
4 in turn, each with `--iteration-details`. Prints TTFT and inter-token latency medians
and p99 (client), and from the engines' iteration details the forward seconds of steps
that prefilled and of steps that only decoded, and how many steps prefilled.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.workload import mixtral_checkpoint  # noqa: E402
from services.common.sampling import SamplingParams  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.core.engine_core import EngineCore  # noqa: E402
from services.engine.messages import SessionOutputs  # noqa: E402
from services.engine.request import Request  # noqa: E402
from tests.unit.engine.fakes import FakeRunner  # noqa: E402

WAYS = ("off", "engine flag", "session asked")


def loop_us_per_step(way: str, steps: int) -> float:
    """Microseconds per busy-loop step over one request of `steps` tokens."""
    runner = FakeRunner(num_blocks=steps // 4 + 8, max_model_len=steps + 8)
    core = EngineCore(EngineConfig(iteration_details=way == "engine flag",
                                   max_num_batched_tokens=steps + 8), runner)
    q = core.sessions.open("s")
    if way == "session asked":
        core.sessions.subscribe_details("s")
    core.start()
    try:
        start = time.perf_counter()
        core.add_request(Request("a", [1, 2, 3], SamplingParams(
            temperature=0.0, max_tokens=steps, ignore_eos=True), session_id="s"))
        while True:
            item = q.get(timeout=60)
            if isinstance(item, SessionOutputs) and any(u.finished for u in item.updates):
                break
        return (time.perf_counter() - start) / steps * 1e6
    finally:
        core.shutdown()


def cost(args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    loop_us_per_step("off", 200)  # warm-up
    for _ in range(args.rounds):
        for way in WAYS:
            times[way].append(loop_us_per_step(way, args.steps))
    off = statistics.median(times["off"])
    print(f"\nbusy loop on a runner that computes nothing, {args.steps} steps, "
          f"median of {args.rounds} rounds")
    print(f"{'details':<16}{'us/step':>10}{'vs off':>12}")
    for way in WAYS:
        median = statistics.median(times[way])
        print(f"{way:<16}{median:>10.1f}{median - off:>+11.1f}u")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def throttle_run(model: Path, interval: int, args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    from tests.integration.cluster import Cluster
    from tests.unit.engine.fakes import SessionClient

    cluster = Cluster(["--model", str(model), "--engines", "2", "--kv-cache-memory", "64MiB",
                       "--prefill-schedule-interval", str(interval), "--iteration-details"],
                      env={"OMP_NUM_THREADS": "1"})
    details: list[Any] = []
    try:
        # (The engines' addresses are read from their logs, at info level.)
        sessions = [SessionClient(grpc.insecure_channel(a), iteration_details=True)
                    for a in cluster.engine_addresses]
        assert len(sessions) == 2, cluster.engine_addresses

        def read(session: SessionClient) -> None:
            for msg in session.responses:
                if msg.HasField("iteration_details"):
                    details.append(msg.iteration_details)

        readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in sessions]
        for reader in readers:
            reader.start()
        rng = random.Random(3)
        ttfts: list[float] = []
        gaps: list[float] = []
        lock = threading.Lock()

        def stream(stub: Any, rank: int, prompt: list[int]) -> None:
            start = time.perf_counter()
            last = None
            for _ in stub.GenerateStream(pb.GenerateStreamRequest(
                    token_ids=pb.TokenIds(ids=prompt), data_parallel_rank=rank,
                    sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=32,
                                                       ignore_eos=True)), timeout=300):
                now = time.perf_counter()
                with lock:
                    (ttfts.append(now - start) if last is None else gaps.append(now - last))
                last = now

        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            threads = []
            for i in range(args.requests):
                prompt = [rng.randrange(3, 390) for _ in range(rng.randrange(16, 97))]
                thread = threading.Thread(target=stream, args=(stub, i % 2, prompt))
                thread.start()
                threads.append(thread)
                time.sleep(rng.expovariate(1 / 0.05))
            for thread in threads:
                thread.join()
        if len(ttfts) != args.requests:
            raise RuntimeError(f"{args.requests - len(ttfts)} streams failed (see above)")
        for session in sessions:
            session.close()
        for reader in readers:
            reader.join(30)
    finally:
        cluster.stop()
    prefill = [d.forward_seconds for d in details if d.num_prefill_requests]
    decode = [d.forward_seconds for d in details if not d.num_prefill_requests]
    return {"ttft": ttfts, "itl": gaps, "prefill_forward": prefill, "decode_forward": decode}


def throttle(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = mixtral_checkpoint(Path(tmp) / "mixtral")
        results = {n: throttle_run(model, n, args) for n in (1, 4)}
    print(f"\n2 expert-parallel engines, {args.requests} streams (32 tokens), random "
          "arrivals on both ranks; milliseconds, median / p99")
    print(f"{'interval':<10}{'TTFT':>16}{'ITL':>16}{'forward, prefill steps':>26}"
          f"{'forward, decode steps':>24}{'prefill steps':>15}")
    for n, r in results.items():
        def cell(values: list[float]) -> str:
            return (f"{statistics.median(values) * 1e3:.1f} / "
                    f"{percentile(values, 0.99) * 1e3:.1f}")
        print(f"{n:<10}{cell(r['ttft']):>16}{cell(r['itl']):>16}"
              f"{cell(r['prefill_forward']):>26}{cell(r['decode_forward']):>24}"
              f"{len(r['prefill_forward']):>15}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--skip-throttle", action="store_true")
    args = parser.parse_args()
    cost(args)
    if not args.skip_throttle:
        throttle(args)


if __name__ == "__main__":
    main()
