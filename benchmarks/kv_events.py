"""What publishing KV-cache events in vLLM's format costs (#41): cluster throughput
with `--kv-events-endpoint` (and a replay socket) against the same cluster without.

    .venv/bin/python benchmarks/kv_events.py                  # 32 requests x 3 rounds
    .venv/bin/python benchmarks/kv_events.py --num-requests 128 --rounds 5

Two `corestream serve` clusters run side by side on the benchmark checkpoint and the
mixed workload (benchmarks/side_by_side.py: alternating rounds, output tokens per
second and the CPU seconds of the cluster's processes). The publishing one dials a
subscriber in this process that reads every message as an indexer would, so that the
events are really sent; it prints how many batches, events and stored blocks arrived.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.side_by_side import parse_args, report, run_rounds, start  # noqa: E402
from benchmarks.workload import bench_checkpoint, mixed_workload  # noqa: E402


class Counter:
    """A bound SUB socket read by its own thread until stopped."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.batches = self.events = self.blocks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.socket.poll(100):
                _, _, payload = self.socket.recv_multipart()
                events = msgpack.unpackb(payload)[1]
                self.batches += 1
                self.events += len(events)
                self.blocks += sum(len(e["block_hashes"]) for e in events
                                   if e["type"] == "BlockStored")
        self.socket.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])

    model = bench_checkpoint()
    workload = mixed_workload(args.num_requests)
    counter = Counter()
    replay_port = counter.port + 1 if counter.port < 65535 else counter.port - 1
    arms = [start("events off", model, args.max_num_seqs, args.kv_cache_memory),
            start("events on", model, args.max_num_seqs, args.kv_cache_memory,
                  ["--kv-events-endpoint", f"tcp://127.0.0.1:{counter.port}",
                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
                   "--kv-events-topic", "kv@127.0.0.1@bench"])]
    try:
        run_rounds(arms, workload, args.rounds)
    finally:
        for arm in arms:
            arm.cluster.stop()
        counter.stop()
    print(f"\n{args.num_requests} requests x {args.rounds} rounds, "
          f"{sum(r.max_tokens for r in workload)} output tokens each")
    report(*arms)
    print(f"received: {counter.batches} batches, {counter.events} events, "
          f"{counter.blocks} stored blocks")


if __name__ == "__main__":
    main()
