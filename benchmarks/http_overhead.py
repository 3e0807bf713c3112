"""The HTTP door's cost: streaming throughput through /v1/completions beside gRPC.

    .venv/bin/python benchmarks/http_overhead.py [--num-requests 128] [--rounds 3]

One cluster on the fixed-logits model (services/engine/models/fixed_logits.py: the
model costs nothing, so the serving path is all there is to measure) serves both
doors. The same workload (prompts as token ids, greedy, ignore_eos) streams through
GenerateService over gRPC and through the OpenAI-compatible HTTP API as server-sent
events, in alternating rounds so that both see the same machine noise; each round
counts the tokens that arrived. Prints tokens/s per round, the medians, and the
HTTP/gRPC ratio (the target is at least 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.throughput import stream_all  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    BenchRequest,
    fixed_logits_checkpoint,
    mixed_workload,
    warmup_workload,
)

MODEL_NAME = "bench"


async def stream_all_http(port: int, batch: list[BenchRequest]) -> int:
    """Send the whole batch at once over HTTP; the number of tokens that arrived, counted
    from vLLM's `return_token_ids` (as the gRPC door's chunks carry token ids: asking
    for logprobs instead would make the engine compute them for HTTP only)."""
    import httpx

    limits = httpx.Limits(max_connections=len(batch), max_keepalive_connections=len(batch))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                 timeout=1800) as client:

        async def one(r: BenchRequest) -> int:
            body = {"model": MODEL_NAME, "prompt": r.prompt, "max_tokens": r.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
            n = 0
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        n += len(choice["token_ids"])
            return n

        return sum(await asyncio.gather(*(one(r) for r in batch)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()

    from tests.integration.cluster import Cluster, free_port

    model = fixed_logits_checkpoint()
    workload = mixed_workload(args.num_requests)
    expected = sum(r.max_tokens for r in workload)
    http_port = free_port()
    cluster = Cluster(["--model", str(model), "--served-model-name", MODEL_NAME,
                       "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
                       "--http-port", str(http_port)])
    rates: dict[str, list[float]] = {"grpc": [], "http": []}
    try:
        asyncio.run(stream_all(cluster.address, warmup_workload()))
        asyncio.run(stream_all_http(http_port, warmup_workload()))
        print(f"fixed-logits model, {len(workload)} concurrent streams, {expected} output "
              "tokens per round", flush=True)
        for round_index in range(args.rounds):
            for door in ("grpc", "http"):
                start = time.perf_counter()
                if door == "grpc":
                    generated = asyncio.run(stream_all(cluster.address, workload))
                else:
                    generated = asyncio.run(stream_all_http(http_port, workload))
                seconds = time.perf_counter() - start
                assert generated == expected, (door, generated, expected)
                rates[door].append(generated / seconds)
                print(f"round {round_index} {door:<4} {generated / seconds:>9.1f} tok/s "
                      f"({seconds:.2f} s)", flush=True)
    finally:
        cluster.stop()
    grpc_median, http_median = (statistics.median(rates[d]) for d in ("grpc", "http"))
    print(f"median gRPC {grpc_median:.1f} tok/s, HTTP {http_median:.1f} tok/s, "
          f"HTTP/gRPC {http_median / grpc_median:.3f}x")


if __name__ == "__main__":
    main()
