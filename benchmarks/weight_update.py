"""Live weight updates through `corestream serve` (one engine), against the machine's
memory bandwidth.

    .venv/bin/python -m benchmarks.weight_update              # both checkpoints, 3 rounds
    .venv/bin/python -m benchmarks.weight_update --quick      # the bench checkpoint, 1 round
    .venv/bin/python -m benchmarks.weight_update --models smollm2 --rounds 5

For each checkpoint (the benchmark checkpoint, benchmarks/workload.py, ~111 MB; random
weights in SmolLM2-135M's shapes, float32, ~540 MB), in one cluster, after two untimed
updates from disk (printed: the first ones take fresh memory and run up to 2-3x longer):

1. disk: AdminService UpdateWeightsFromDisk of the whole checkpoint folder (the folder the
   engine serves, in the page cache since the engine read it: what a trainer that has
   just written its checkpoint hands over), the RPC's wall time; GB/s is the checkpoint's
   tensor bytes over it.
2. gloo: a trainer process (rank 0 of a weight-transfer group with the engine) holding
   the checkpoint's tensors in memory; StartWeightUpdate, UpdateWeights while the trainer
   broadcasts every tensor, FinishWeightUpdate, timed from the first call's start to
   the last's end. The group is joined once, before the rounds, as an RL loop would.
   The engine's own figures ride along: its receive time and its commit time.
3. pause: `--streams` greedy streams decode; PauseScheduling (keep), UpdateWeightsFromDisk,
   ResumeScheduling; timed from the pause call to the first token that carries the new
   weight version, as the client sees it. Then the same update without a pause, while
   the streams run (the engine stages beside serving and swaps between two steps): the
   longest gap between two tokens of any stream around it.
4. around them: single-stream decode ms/token before the first update and after the last,
   and the engine's resident memory at start, at the end and at its peak (VmHWM).

The copy bandwidth is `dst.copy_(src)` over two buffers of `--copy-mib` each (far past the
last-level cache), bytes read plus written per second, the median of 10, on all the
driver's threads and on one; each update's GB/s is printed as a fraction of the first.
The figures are medians of `--rounds` rounds; the engine uses both cores and shares them
with the trainer, the streams' client and the frontend.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.workload import VOCAB, bench_checkpoint, smollm2_shaped_checkpoint  # noqa: E402

MODELS = {"bench": bench_checkpoint, "smollm2": smollm2_shaped_checkpoint}
PROMPT_LEN = 16
WARM_TOKENS = 8
"""Tokens each stream makes before the update starts."""
MAX_TOKENS = 1800
"""Longer than any round: streams are cancelled once they saw the new version."""


# ---- the machine -----------------------------------------------------------------


def cpu_line() -> str:
    """lscpu's model name and family, the flags that matter to the kernels, the CPUs."""
    fields: dict[str, str] = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = {k.strip(): v.strip() for k, _, v in
                  (line.partition(":") for line in text.splitlines())}
    except (OSError, subprocess.CalledProcessError):
        pass
    have = set(fields.get("Flags", "").split())
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16") if f in have)
    return (f"CPU: {fields.get('Model name', '?')}, family {fields.get('CPU family', '?')} "
            f"model {fields.get('Model', '?')}; {os.cpu_count()} CPUs; "
            f"flags: {flags or 'none of avx2 avx512f avx512_bf16'}")


def copy_bandwidth(mib: int, threads: int | None = None, calls: int = 10) -> float:
    """GB/s of bytes read plus written by a torch copy between two `mib` MiB buffers."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**20 // 4)
        dst = torch.zeros_like(src)
        dst.copy_(src)  # pages in
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def checkpoint_bytes(folder: Path) -> int:
    """The tensors' bytes in the folder's safetensors files, from their headers."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for name, t in header.items() if name != "__metadata__")
    return total


# ---- the trainer process ---------------------------------------------------------


def trainer_main(port: int, folder: Path) -> None:
    """Rank 0 of a two-rank group: load the checkpoint, print its update_info as one JSON
    line, join, print "joined"; then broadcast every tensor per line read on stdin and
    print "sent" after each."""
    from safetensors.torch import load_file

    from services.engine.weights.trainer import broadcast_weights, trainer_group, update_info

    tensors = [item for file in sorted(folder.glob("*.safetensors"))
               for item in load_file(file).items()]
    print(json.dumps(update_info(tensors)), flush=True)
    group = trainer_group("127.0.0.1", port, 2, timeout_s=120)
    print("joined", flush=True)
    for _ in sys.stdin:
        broadcast_weights(group, tensors)
        print("sent", flush=True)
    os._exit(0)  # gloo's threads need no orderly shutdown


class Trainer:
    def __init__(self, admin: Any, folder: Path) -> None:
        from corestream.generate.v1 import admin_service_pb2 as admin_pb

        from services.common.ports import free_port

        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.weight_update", "--trainer", str(port),
             str(folder)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        info = json.loads(self._stdout.readline())
        self.announce = admin_pb.UpdateWeightsRequest(
            names=info["names"], dtype_names=info["dtype_names"],
            shapes=[admin_pb.TensorShape(dims=s) for s in info["shapes"]])
        reply = admin.InitWeightTransfer(admin_pb.InitWeightTransferRequest(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            timeout_s=120), timeout=180)
        assert reply.ok, reply
        assert self._stdout.readline().strip() == "joined"

    def go(self) -> None:
        self._stdin.write("go\n")
        self._stdin.flush()

    def wait_sent(self) -> None:
        line = self._stdout.readline().strip()
        assert line == "sent", f"trainer: {line!r}"

    def stop(self) -> None:
        self._stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- one cluster's rounds -----------------------------------------------------------


@dataclass
class Figures:
    first: list[float] = field(default_factory=list)
    """The first two updates (untimed warm-ups): fresh memory for the staged tensors."""
    decode_ms: dict[str, float] = field(default_factory=dict)
    memory_mb: dict[str, float] = field(default_factory=dict)
    disk: list[float] = field(default_factory=list)
    disk_commit: list[float] = field(default_factory=list)
    gloo: list[float] = field(default_factory=list)
    gloo_receive: list[float] = field(default_factory=list)
    gloo_commit: list[float] = field(default_factory=list)
    paused: list[dict[str, float]] = field(default_factory=list)
    unpaused: list[dict[str, float]] = field(default_factory=list)


def result(reply: Any) -> dict[str, Any]:
    """The one engine's JSON result of an admin reply that must have succeeded."""
    assert reply.ok and len(reply.results) == 1, reply
    return json.loads(reply.results[0].result_json)


def update_from_disk(admin: Any, folder: Path, version: str) -> tuple[float, dict[str, Any]]:
    from corestream.generate.v1 import admin_service_pb2 as admin_pb

    start = time.perf_counter()
    reply = admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
        path=str(folder), weight_version=version), timeout=600)
    seconds = time.perf_counter() - start
    committed = result(reply)
    assert reply.weight_version == version, reply
    return seconds, committed


def update_over_gloo(admin: Any, trainer: Trainer, version: str
                     ) -> tuple[float, dict[str, Any], dict[str, Any]]:
    from corestream.generate.v1 import admin_service_pb2 as admin_pb

    start = time.perf_counter()
    assert admin.StartWeightUpdate(admin_pb.StartWeightUpdateRequest(), timeout=60).ok
    trainer.go()
    received = result(admin.UpdateWeights(trainer.announce, timeout=600))
    finish = admin.FinishWeightUpdate(admin_pb.FinishWeightUpdateRequest(
        weight_version=version), timeout=600)
    seconds = time.perf_counter() - start
    trainer.wait_sent()
    assert finish.weight_version == version, finish
    return seconds, received, result(finish)


class Stream(threading.Thread):
    """One greedy stream; records (arrival time, weight version, tokens) per chunk."""

    def __init__(self, stub: Any, prompt: list[int]) -> None:
        from corestream.generate.v1 import generate_service_pb2 as pb

        super().__init__(daemon=True)
        self.arrivals: list[tuple[float, str, int]] = []
        self.error: BaseException | None = None
        self.call = stub.GenerateStream(pb.GenerateStreamRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling={
                "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}),
            timeout=900)

    def run(self) -> None:
        import grpc

        try:
            for chunk in self.call:
                if chunk.token_ids:
                    self.arrivals.append((time.perf_counter(), chunk.weight_version,
                                          len(chunk.token_ids)))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc

    def tokens(self) -> int:
        return sum(n for _, _, n in self.arrivals)

    def first_of(self, version: str) -> float | None:
        return next((t for t, v, _ in list(self.arrivals) if v == version), None)


def wait_for(condition: Any, streams: list[Stream], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        errors = [s.error for s in streams if s.error is not None]
        if errors or time.monotonic() > deadline:
            raise RuntimeError(f"streams stalled or failed: {errors or 'timeout'}")
        time.sleep(0.002)


def streamed_update(admin: Any, stub: Any, folder: Path, version: str, num_streams: int,
                    pause: bool, seed: int) -> dict[str, float]:
    """An update from disk while `num_streams` streams decode, with or without a keep
    pause around it; the client-side timings."""
    from corestream.generate.v1 import admin_service_pb2 as admin_pb

    rng = random.Random(seed)
    streams = [Stream(stub, [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)])
               for _ in range(num_streams)]
    for s in streams:
        s.start()
    try:
        wait_for(lambda: all(s.tokens() >= WARM_TOKENS for s in streams), streams)
        start = time.perf_counter()
        if pause:
            admin.PauseScheduling(admin_pb.PauseSchedulingRequest(
                mode=admin_pb.PAUSE_MODE_KEEP), timeout=60)
        paused = time.perf_counter()
        seconds, committed = update_from_disk(admin, folder, version)
        updated = time.perf_counter()
        if pause:
            admin.ResumeScheduling(admin_pb.ResumeSchedulingRequest(), timeout=60)
        resumed = time.perf_counter()
        wait_for(lambda: all(s.first_of(version) is not None for s in streams), streams)
    finally:
        for s in streams:
            s.call.cancel()
        for s in streams:
            s.join(30)
    switched = [s.first_of(version) or 0.0 for s in streams]
    first = min(switched)
    # The longest wait between two chunks of a stream, from the start up to its first
    # token on the new weights.
    stall = max(b[0] - a[0] for s, end in zip(streams, switched, strict=True)
                for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)
                if start < b[0] <= end)
    assert all(s.tokens() < MAX_TOKENS for s in streams), "a stream ended before the update"
    return {"to_first_token": first - start, "pause": paused - start, "update": seconds,
            "commit": committed["commit_seconds"], "resume": resumed - updated,
            "resume_to_token": first - resumed, "longest_stall": stall}


def decode_ms(stub: Any, seed: int, streams: int = 3, tokens: int = 128) -> float:
    """Median ms between tokens of single greedy streams, one after another."""
    from corestream.generate.v1 import generate_service_pb2 as pb

    rng = random.Random(seed)
    gaps = []
    for _ in range(streams):
        arrivals = [time.perf_counter() for chunk in stub.GenerateStream(
            pb.GenerateStreamRequest(
                token_ids=pb.TokenIds(ids=[rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]),
                sampling={"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}),
            timeout=300) if chunk.token_ids]
        gaps += [b - a for a, b in zip(arrivals[8:], arrivals[9:], strict=False)]
    return statistics.median(gaps) * 1000


def memory_mb(pid: int) -> dict[str, float]:
    """A process's resident and peak resident memory (MB)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return {key: int(status[key].split()[0]) * 1024 / 1e6 for key in ("VmRSS", "VmHWM")}


def run_model(name: str, args: argparse.Namespace) -> tuple[Path, int, Figures]:
    import grpc
    from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    from tests.integration.cluster import Cluster

    folder = MODELS[name]()
    nbytes = checkpoint_bytes(folder)
    print(f"{folder.name}: {nbytes / 1e6:.0f} MB; starting corestream serve ...", flush=True)
    cluster = Cluster(["--model", str(folder), "--log-level", "warning",
                       "--kv-cache-memory", args.kv_cache_memory, "--weight-version", "v0"],
                      startup_timeout=600)
    channel = grpc.insecure_channel(cluster.address)
    admin = admin_grpc.AdminServiceStub(channel)
    stub = pb_grpc.GenerateServiceStub(channel)
    figures = Figures()
    trainer: Trainer | None = None
    try:
        engine = cluster.engine_pid(0)
        figures.memory_mb["start"] = memory_mb(engine)["VmRSS"]
        figures.decode_ms["before"] = decode_ms(stub, seed=1)
        for warm in ("warm0", "warm1"):
            seconds, committed = update_from_disk(admin, folder, warm)
            assert committed["num_bytes"] == nbytes, (committed["num_bytes"], nbytes)
            figures.first.append(seconds)
        for r in range(args.rounds):
            seconds, committed = update_from_disk(admin, folder, f"disk{r}")
            figures.disk.append(seconds)
            figures.disk_commit.append(committed["commit_seconds"])
        trainer = Trainer(admin, folder)
        for r in range(args.rounds):
            seconds, received, committed = update_over_gloo(admin, trainer, f"gloo{r}")
            assert received["num_bytes"] == nbytes, (received["num_bytes"], nbytes)
            figures.gloo.append(seconds)
            figures.gloo_receive.append(received["seconds"])
            figures.gloo_commit.append(committed["commit_seconds"])
        for r in range(args.rounds):
            figures.paused.append(streamed_update(
                admin, stub, folder, f"paused{r}", args.streams, pause=True, seed=r))
            figures.unpaused.append(streamed_update(
                admin, stub, folder, f"live{r}", args.streams, pause=False, seed=100 + r))
        figures.decode_ms["after"] = decode_ms(stub, seed=2)
        memory = memory_mb(engine)
        figures.memory_mb["end"], figures.memory_mb["peak"] = memory["VmRSS"], memory["VmHWM"]
    except BaseException:
        print(cluster.output(), file=sys.stderr)
        raise
    finally:
        if trainer is not None:
            trainer.stop()
        channel.close()
        cluster.stop()
    return folder, nbytes, figures


# ---- the report ---------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(folder: Path, nbytes: int, f: Figures, bandwidth: float, streams: int) -> None:
    def row(label: str, seconds: list[float], note: str) -> None:
        gbps = nbytes / median(seconds) / 1e9
        each = " ".join(f"{s:.3f}" for s in seconds)
        print(f"  {label:34} {median(seconds):8.3f} {gbps:6.2f} {gbps / bandwidth:9.3f}  "
              f"[{each}]  {note}")

    print(f"\n{folder.name} ({nbytes / 1e6:.0f} MB of tensors), 1 engine")
    print(f"  {'update':34} {'median s':>8} {'GB/s':>6} {'x copy bw':>9}  [rounds]")
    row("disk: UpdateWeightsFromDisk", f.disk,
        f"engine commit {median(f.disk_commit):.3f} s")
    row("gloo: start + broadcast + finish", f.gloo,
        f"engine receive {median(f.gloo_receive):.3f} s, commit {median(f.gloo_commit):.3f} s")
    print(f"  the first two updates (untimed): {f.first[0]:.3f} and {f.first[1]:.3f} s")

    columns = {"to_first_token": "to token", "longest_stall": "stall", "pause": "pause",
               "update": "update", "commit": "commit", "resume": "resume",
               "resume_to_token": "resume->token"}
    title = f"{streams} streams decoding, client's view (median s)"
    print(f"\n  {title:45} " + " ".join(f"{c:>{max(len(c), 6)}}" for c in columns.values()))
    for label, rounds in (("keep pause -> disk -> resume", f.paused),
                          ("disk update, no pause", f.unpaused)):
        cells = [f"{median([r[k] for r in rounds]):.3f}"
                 if rounds is f.paused or k not in ("pause", "resume", "resume_to_token")
                 else "-" for k in columns]
        print(f"  {label:45} " + " ".join(f"{cell:>{max(len(c), 6)}}"
                                          for cell, c in zip(cells, columns.values(),
                                                             strict=True)))
    before, after = f.decode_ms["before"], f.decode_ms["after"]
    print(f"\n  decode, 1 stream: {before:.2f} ms/token before any update, {after:.2f} after "
          f"them ({after / before:.2f}x); engine RSS {f.memory_mb['start']:.0f} MB at start, "
          f"{f.memory_mb['end']:.0f} at the end, peak {f.memory_mb['peak']:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bench,smollm2",
                        help="comma-separated: bench (~111 MB), smollm2 (~540 MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4,
                        help="streams decoding during the pause/no-pause updates")
    parser.add_argument("--copy-mib", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--quick", action="store_true",
                        help="a sanity run: the bench checkpoint, 1 round, 2 streams")
    parser.add_argument("--trainer", nargs=2, metavar=("PORT", "FOLDER"),
                        help=argparse.SUPPRESS)  # the trainer process this script starts
    args = parser.parse_args()
    if args.trainer:
        trainer_main(int(args.trainer[0]), Path(args.trainer[1]))
        return
    if args.quick:
        args.models, args.rounds, args.streams, args.copy_mib = "bench", 1, 2, 256
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(MODELS)}")

    import torch

    print(cpu_line())
    bandwidth = copy_bandwidth(args.copy_mib)
    single = copy_bandwidth(args.copy_mib, threads=1)
    print(f"copy bandwidth (read + write, {args.copy_mib} MiB buffers): {bandwidth:.1f} GB/s "
          f"on {torch.get_num_threads()} threads, {single:.1f} GB/s on 1; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    results = [run_model(name, args) for name in names]
    for folder, nbytes, figures in results:
        report(folder, nbytes, figures, bandwidth, args.streams)
    print(f"\nrounds: {args.rounds}; GB/s: the checkpoint's tensor bytes over the wall time; "
          f"x copy bw: that over {bandwidth:.1f} GB/s; load average at the end "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
