"""Offline throughput: corestream (in process and through the gRPC cluster) vs transformers.

    .venv/bin/python benchmarks/throughput.py                 # the full run (slow: HF)
    .venv/bin/python benchmarks/throughput.py --num-requests 32 --skip-hf

Workload: 128 requests, prompts 16-512 random token ids, outputs 16-256 tokens, greedy,
ignore_eos, seeded; a warm-up on other prompts first. Prints output and total tokens
per second for each system and the ratios to transformers, and a ceiling no float32
engine can pass on this machine: the workload's matmul FLOPs (attention left out) over
the best float32 matmul rate measured here, on 2048-row chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.workload import (  # noqa: E402
    BenchRequest,
    bench_checkpoint,
    mixed_workload,
    warmup_workload,
)


@dataclass(frozen=True)
class Result:
    name: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    steps: int = 0
    """Engine steps taken (busy-loop iterations that ran the model)."""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


def prompt_tokens(workload: list[BenchRequest]) -> int:
    return sum(len(r.prompt) for r in workload)


# ---- corestream, in process -------------------------------------------------------


def run_engine(model: Path, workload: list[BenchRequest], args: argparse.Namespace) -> Result:
    from services.common.sampling import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.core.engine_core import EngineCore
    from services.engine.messages import SessionOutputs
    from services.engine.request import Request
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.heap import keep_freed_memory
    from services.engine.worker.model_runner import ModelRunner

    runner = ModelRunner(RunnerConfig(model=str(model), kv_cache_memory=args.kv_cache_memory,
                                      device=args.device))
    runner.warmup()
    runner.settle()
    keep_freed_memory()  # as the engine process does once warm
    core = EngineCore(EngineConfig(max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens), runner)
    outputs = core.sessions.open("bench")
    core.start()

    def run(batch: list[BenchRequest], tag: str) -> tuple[float, int]:
        start = time.perf_counter()
        for i, r in enumerate(batch):
            sampling = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            core.add_request(Request(f"{tag}{i}", list(r.prompt), sampling, eos_token_ids=(2,),
                                     session_id="bench"))
        pending, generated = len(batch), 0
        while pending:
            item = outputs.get(timeout=600)
            assert isinstance(item, SessionOutputs)
            for u in item.updates:
                assert u.error_code == 0, u.error_message
                generated += len(u.new_token_ids)
                pending -= u.finished
        return time.perf_counter() - start, generated

    try:
        run(warmup_workload(), "warm")
        steps_before = core.stats.step_counter
        seconds, generated = run(workload, "r")
        steps = core.stats.step_counter - steps_before
    finally:
        core.shutdown()
    assert generated == sum(r.max_tokens for r in workload), generated
    return Result("corestream engine (in process)", seconds, generated, prompt_tokens(workload),
                  steps)


# ---- corestream, full gRPC cluster -----------------------------------------------------

STREAMS_PER_CONNECTION = 50


async def stream_all(address: str, batch: list[BenchRequest]) -> int:
    """Send the whole batch at once; the number of tokens generated."""
    import grpc
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    # The frontend allows a bounded number of concurrent streams per connection, and a
    # fresh connection may be sent more before it has heard the limit (REFUSED_STREAM):
    # one connection of its own per STREAMS_PER_CONNECTION requests.
    num_channels = -(-len(batch) // STREAMS_PER_CONNECTION)
    channels = [grpc.aio.insecure_channel(address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(num_channels)]

    async def one(i: int, r: BenchRequest) -> int:
        stub = pb_grpc.GenerateServiceStub(channels[i % num_channels])
        request = pb.GenerateStreamRequest(
            token_ids=pb.TokenIds(ids=r.prompt),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                               ignore_eos=True),
        )
        n = 0
        async for chunk in stub.GenerateStream(request, timeout=1800):
            n += len(chunk.token_ids)
        return n

    try:
        return sum(await asyncio.gather(*(one(i, r) for i, r in enumerate(batch))))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def _engine_steps(coordinator: str) -> int:
    import grpc
    from corestream.coordinator.v1 import coordinator_service_pb2 as pb
    from corestream.coordinator.v1 import coordinator_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(coordinator) as channel:
        reply = pb_grpc.CoordinatorServiceStub(channel).ListEngines(pb.ListEnginesRequest())
    return sum(e.step_counter for e in reply.engines)


def run_cluster(model: Path, workload: list[BenchRequest], args: argparse.Namespace) -> Result:
    from tests.integration.cluster import Cluster, free_port

    coordinator = f"127.0.0.1:{free_port()}"
    cluster = Cluster(["--model", str(model), "--max-num-seqs", str(args.max_num_seqs),
                       "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                       "--kv-cache-memory", str(args.kv_cache_memory), "--log-level", "warning",
                       "--coordinator-port", coordinator.rsplit(":", 1)[1]])
    try:
        asyncio.run(stream_all(cluster.address, warmup_workload()))
        time.sleep(1.5)  # let the load report with the step counter settle
        steps_before = _engine_steps(coordinator)
        start = time.perf_counter()
        generated = asyncio.run(stream_all(cluster.address, workload))
        seconds = time.perf_counter() - start
        time.sleep(1.5)
        steps = _engine_steps(coordinator) - steps_before
    finally:
        cluster.stop()
    assert generated == sum(r.max_tokens for r in workload), generated
    return Result("corestream cluster (gRPC)", seconds, generated, prompt_tokens(workload), steps)


# ---- the ceiling: the workload's matmuls at this machine's best float32 rate -----------


def matmul_ceiling(model: Path, workload: list[BenchRequest], device: str) -> tuple[float, float]:
    """(best float32 matmul GFLOP/s measured on the model's layer shapes at 2048 rows,
    the most output tokens/s the workload allows at that rate)."""
    import json

    import torch

    from services.engine.worker.model_runner import pick_device

    dev = pick_device(device)
    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    shapes = [(hidden, qkv), (config["num_attention_heads"] * head_dim, hidden),
              (hidden, 2 * inter), (inter, hidden)]
    layer_macs = sum(k * n for k, n in shapes)
    rows = 2048
    inputs = [(torch.randn(rows, k, device=dev), torch.randn(k, n, device=dev))
              for k, n in shapes]
    best = float("inf")
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for a, w in inputs:
            torch.mm(a, w)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    rate = 2 * rows * layer_macs / best
    outputs = sum(r.max_tokens for r in workload)
    tokens = prompt_tokens(workload) + outputs
    flops = 2 * (tokens * layer_macs * config["num_hidden_layers"]
                 + outputs * hidden * config["vocab_size"])  # logits of sampled rows only
    return rate / 1e9, outputs / (flops / rate)


# ---- the reference: transformers generate in padded batches -----------------------------


def run_hf(model: Path, workload: list[BenchRequest], batch_size: int, device: str) -> Result:
    import torch
    from transformers import LlamaForCausalLM

    from services.engine.worker.model_runner import pick_device

    device = str(pick_device(device))  # the engine's reading of "auto"
    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval().to(device)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def generate(batch: list[BenchRequest]) -> None:
        width = max(len(r.prompt) for r in batch)
        # Left padding, as generation needs the prompts to end together.
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch],
                           device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch],
                            device=device)
        new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                        max_new_tokens=new, min_new_tokens=new)
        if device != "cpu":
            torch.cuda.synchronize()

    generate(warmup_workload()[:4])
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        generate(workload[i : i + batch_size])
    seconds = time.perf_counter() - start
    # Tokens past a request's own max_tokens are padding work, not output.
    return Result(f"transformers generate (batches of {batch_size})", seconds,
                  sum(r.max_tokens for r in workload), prompt_tokens(workload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--hf-requests", type=int, default=0,
                        help="run transformers on the first N requests only (0 = all); its "
                        "tokens/s are then compared with ours on the whole workload")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2147483648")
    parser.add_argument("--device", default="auto",
                        help="where the engine in process and transformers run (auto: CUDA "
                        "when present); the cluster always picks its own")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-cluster", action="store_true")
    args = parser.parse_args()

    model = bench_checkpoint()
    workload = mixed_workload(args.num_requests)
    print(f"workload: {len(workload)} requests, {prompt_tokens(workload)} prompt tokens, "
          f"{sum(r.max_tokens for r in workload)} output tokens; torch threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}", flush=True)
    results: list[Result] = []
    if not args.skip_hf:
        hf_workload = workload[: args.hf_requests] if args.hf_requests else workload
        results.append(run_hf(model, hf_workload, args.hf_batch_size, args.device))
        print(f"  {results[-1].name}: {results[-1].seconds:.1f}s", flush=True)
    if not args.skip_engine:
        results.append(run_engine(model, workload, args))
        print(f"  {results[-1].name}: {results[-1].seconds:.1f}s", flush=True)
    if not args.skip_cluster:
        results.append(run_cluster(model, workload, args))
        print(f"  {results[-1].name}: {results[-1].seconds:.1f}s", flush=True)

    reference = results[0] if not args.skip_hf else None
    print(f"\n{'system':<44} {'output tok/s':>13} {'total tok/s':>12} {'x output':>9}")
    for r in results:
        ratio = f"{r.output_tps / reference.output_tps:.1f}x" if reference else "-"
        print(f"{r.name:<44} {r.output_tps:>13.1f} {r.total_tps:>12.1f} {ratio:>9}")
    gflops, ceiling = matmul_ceiling(model, workload, args.device)
    ratio = f"{ceiling / reference.output_tps:.1f}x" if reference else "-"
    print(f"{'ceiling: matmuls alone at ' + f'{gflops:.0f} GFLOP/s':<44} {ceiling:>13.1f} "
          f"{'':>12} {ratio:>9}")


if __name__ == "__main__":
    main()
