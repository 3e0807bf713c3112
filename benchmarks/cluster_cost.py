"""What the cluster adds to each token: inter-token latency and CPU time per token by process.

    .venv/bin/python benchmarks/cluster_cost.py [--requests 5] [--streams 1] [--fixed-logits]
                                                [--step-ms MS] [--threads]

Runs `corestream serve` on the benchmark checkpoint (or, with --fixed-logits, on a model
that costs nothing, so that only the serving path is left), sends `--requests` greedy
streams `--streams` at a time, and prints the median inter-token latency seen by the
client, the CPU time (user + system, from /proc) that the client and each serve child
(coordinator, engine, frontend) spent per generated token during the timed run, and each
child's context switches per token (thread wake-ups). On a machine with few cores every
bit of that CPU runs beside the model's step and slows it; CPU time per token is also
much steadier than wall time on a shared machine: use it to compare trees.
`--step-ms 5` paces the fixed-logits model (each step sleeps 5 ms, as long as the benchmark
model's step, without its CPU): every token then wakes every thread of the serving path
once, as with a real model, and the serving path's CPU per token is all that is measured.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.latency import stream_once  # noqa: E402
from benchmarks.workload import VOCAB, bench_checkpoint, fixed_logits_checkpoint  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")
BUSY = ("engine", "frontend")
"""The serve children whose threads --threads lists."""


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of a process so far
    (threads that already exited are not counted)."""
    return sum(voluntary + involuntary for _, voluntary, involuntary in
               thread_stats(pid).values())


def thread_stats(pid: int) -> dict[str, tuple[float, int, int]]:
    """{"<name>:<tid>": (CPU seconds, voluntary, involuntary context switches)} of every
    live thread of a process."""
    stats = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(line.split(":", 1) for line in
                          (task / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue  # the thread exited meanwhile
        stats[f"{name}:{task.name}"] = (
            (int(fields[11]) + int(fields[12])) / _TICKS,
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
        )
    return stats


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve_children(serve_pid: int) -> dict[str, int]:
    """{"coordinator": pid, "engine": pid, "frontend": pid} below `serve_pid`."""
    from tests.integration.cluster import descendants

    found = {}
    for pid in descendants(serve_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"services.cli" in argv:
            found[argv[argv.index(b"services.cli") + 1].decode()] = pid
    return found


def run(stub: object, prompts: list[list[int]], streams: int,
        max_tokens: int) -> list[float]:
    """Every prompt once, `streams` at a time; the inter-token gaps of all of them."""
    gaps: list[float] = []
    todo = list(prompts)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            _, g = stream_once(stub, prompt, max_tokens)
            with lock:
                gaps.extend(g)

    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", action="store_true",
                        help="also the engine's and the frontend's busiest threads: CPU and "
                        "context switches "
                        "per token each (a thread that sleeps and wakes per op shows here)")
    parser.add_argument("--fixed-logits", action="store_true",
                        help="a model that costs nothing: only the serving path is left")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="with --fixed-logits: each step sleeps this long")
    args = parser.parse_args()

    import grpc
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    from tests.integration.cluster import Cluster

    if args.step_ms and not args.fixed_logits:
        parser.error("--step-ms paces the --fixed-logits model only")
    model = (fixed_logits_checkpoint(step_seconds=args.step_ms / 1000) if args.fixed_logits
             else bench_checkpoint())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests + args.streams)]

    cluster = Cluster(["--model", str(model), "--log-level", "warning"])
    try:
        pids = serve_children(cluster.proc.pid)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            run(stub, prompts[args.requests:], args.streams, 8)  # warm-up
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            switches_before = {name: context_switches(pid) for name, pid in pids.items()}
            threads_before = {name: thread_stats(pids[name]) for name in BUSY}
            client_before, wall_before = own_cpu_seconds(), time.perf_counter()
            gaps = run(stub, prompts[:args.requests], args.streams, args.output_tokens)
            wall = time.perf_counter() - wall_before
            cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            switches = {name: context_switches(pid) - switches_before[name]
                        for name, pid in pids.items()}
            cpu["client"] = own_cpu_seconds() - client_before
            threads_after = {name: thread_stats(pids[name]) for name in BUSY}
    finally:
        cluster.stop()

    tokens = args.requests * args.output_tokens
    print(f"{args.requests} requests, {args.streams} at a time, prompt {args.prompt_tokens}, "
          f"output {args.output_tokens}, {model.name} model; load average {os.getloadavg()[0]:.2f}")
    print(f"inter-token latency: median {statistics.median(gaps) * 1000:.2f} ms, "
          f"mean {statistics.fmean(gaps) * 1000:.2f} ms; {tokens / wall:.0f} tokens/s")
    print("CPU per token: " + ", ".join(
        f"{name} {cpu[name] / tokens * 1000:.2f} ms"
        for name in ("engine", "frontend", "coordinator", "client") if name in cpu))
    print("context switches per token: " + ", ".join(
        f"{name} {switches[name] / tokens:.1f}"
        for name in ("engine", "frontend", "coordinator") if name in switches))
    if args.threads:
        for name in BUSY:
            before_threads = threads_before[name]
            deltas = {thread: [after - before for after, before in
                               zip(stats, before_threads.get(thread, (0.0, 0, 0)), strict=True)]
                      for thread, stats in threads_after[name].items()}
            print(f"{name} threads, per token (CPU ms, voluntary / involuntary switches):")
            for thread, (cpu_s, voluntary, involuntary) in sorted(
                    deltas.items(), key=lambda kv: -kv[1][0])[:6]:
                print(f"  {thread:<24} {cpu_s / tokens * 1000:6.2f} ms "
                      f"{voluntary / tokens:6.1f} / {involuntary / tokens:.1f}")

if __name__ == "__main__":
    main()
