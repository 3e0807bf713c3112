"""Routing by cached prefix: hit rate, TTFT and throughput of each routing policy.

    .venv/bin/python benchmarks/prefix_routing.py
    .venv/bin/python benchmarks/prefix_routing.py --groups 8 --users 2 --turns 3  # smaller

A seeded multi-turn chat workload on two engines (`corestream serve --engines 2`, the
benchmark checkpoint of benchmarks/workload.py): `--groups` groups share a
`--prefix-len`-token system prompt; each of a group's `--users` users holds a
conversation of `--turns` turns, every turn re-sending the conversation so far plus
a new `--question-len`-token question, answered with `--answer-len` tokens (greedy,
ignore_eos). Users run concurrently; each waits for its answer before its next turn.
The engines' KV caches are sized (`--kv-tokens` each) so that the unique prefixes
exceed one engine's cache but fit in two.

Each policy (cache_aware, least_load, round_robin) runs on a fresh cluster with the
same workload. Printed per policy:
- hit rate: usage.cached_tokens over prompt tokens, against two oracles: the share of
  prompt tokens that an earlier request already sent in its prompt (the issue's
  definition), and the share any earlier request sent or generated (what a single
  infinite cache could hold, since answers are cached too);
- TTFT p50/p90 as the client sees it, output tokens/s over the run;
- requests per engine (the frontend's TTFT histogram counts, by engine) and the
  busiest engine's share against the mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.workload import VOCAB, bench_checkpoint  # noqa: E402
from services.common.block_hash import prompt_block_hashes  # noqa: E402

POLICIES = ("cache_aware", "least_load", "round_robin")
BLOCK_SIZE = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model: Path) -> int:
    """The KV cache's bytes per token for `model`: layers x (k, v) x KV heads x head
    dim x the checkpoint dtype's size, so that `--kv-tokens` holds whatever the model."""
    from services.engine.models.decoder_config import DecoderConfig

    raw = json.loads((model / "config.json").read_text())
    config = DecoderConfig.from_hf(raw)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return (config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim
            * DTYPE_BYTES[dtype])


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    output_tokens: int


@dataclass
class Run:
    policy: str
    seconds: float
    turns: list[Turn] = field(default_factory=list)
    per_engine: dict[str, int] = field(default_factory=dict)


def conversations(args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """(system prompt, questions) per user, seeded."""
    rng = random.Random(args.seed)
    users = []
    for _ in range(args.groups):
        system = [rng.randrange(3, VOCAB) for _ in range(args.prefix_len)]
        for _ in range(args.users):
            questions = [[rng.randrange(3, VOCAB) for _ in range(args.question_len)]
                         for _ in range(args.turns)]
            users.append((system, questions))
    return users


async def run_users(address: str, args: argparse.Namespace
                    ) -> tuple[list[Turn], list[tuple[str, list[int]]]]:
    """Every user's conversation, concurrently; the turns and the prompts in send order."""
    import grpc
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    users = conversations(args)
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options)
                for _ in range(-(-len(users) // 50))]
    turns: list[Turn] = []
    # ("prompt", tokens) when sent, ("answer", prompt + answer) when answered, in order.
    sent: list[tuple[str, list[int]]] = []

    async def user(i: int, system: list[int], questions: list[list[int]]) -> None:
        stub = pb_grpc.GenerateServiceStub(channels[i % len(channels)])
        history = list(system)
        for question in questions:
            prompt = history + question
            sent.append(("prompt", prompt))
            request = pb.GenerateStreamRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=args.answer_len,
                                                   ignore_eos=True))
            start = time.perf_counter()
            ttft = 0.0
            answer: list[int] = []
            cached = 0
            async for chunk in stub.GenerateStream(request, timeout=1800):
                if chunk.token_ids and not ttft:
                    ttft = time.perf_counter() - start
                answer += chunk.token_ids
                if chunk.HasField("usage"):
                    cached = chunk.usage.cached_tokens
            turns.append(Turn(len(prompt), cached, ttft, len(answer)))
            sent.append(("answer", prompt + answer))
            history = prompt + answer

    try:
        await asyncio.gather(*(user(i, s, q) for i, (s, q) in enumerate(users)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return turns, sent


def oracle_rates(sent: list[tuple[str, list[int]]]) -> tuple[float, float]:
    """(prompts only, prompts and answers): the share of prompt tokens whose leading
    blocks some earlier request had sent (or generated), block-granular as a cache is."""
    seen_prompts: set[bytes] = set()
    seen_all: set[bytes] = set()
    hit_prompts = hit_all = total = 0
    for kind, tokens in sent:
        full_blocks = prompt_block_hashes([*tokens, 0], BLOCK_SIZE)
        if kind == "prompt":
            servable = prompt_block_hashes(tokens, BLOCK_SIZE)
            total += len(tokens)
            hit_prompts += _leading(servable, seen_prompts) * BLOCK_SIZE
            hit_all += _leading(servable, seen_all) * BLOCK_SIZE
            seen_prompts.update(full_blocks)
        seen_all.update(full_blocks)
    return hit_prompts / total, hit_all / total


def _leading(hashes: list[bytes], seen: set[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in seen:
            break
        n += 1
    return n


def ttft_counts(metrics_port: int) -> dict[str, int]:
    """Requests per engine: the frontend's TTFT histogram count, by engine label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, int] = {}
    for m in re.finditer(r'^corestream:time_to_first_token_seconds_count\{([^}]*)\} (\S+)$',
                         text, re.M):
        engine = re.search(r'engine="([^"]*)"', m.group(1))
        if engine:
            counts[engine.group(1)] = counts.get(engine.group(1), 0) + int(float(m.group(2)))
    return counts


def run_policy(policy: str, model: Path, args: argparse.Namespace
               ) -> tuple[Run, list[tuple[str, list[int]]]]:
    from tests.integration.cluster import Cluster, free_port

    metrics_port = free_port()
    cluster = Cluster(["--model", str(model), "--engines", "2", "--routing-policy", policy,
                       "--kv-cache-memory", str(args.kv_tokens * kv_bytes_per_token(model)),
                       "--max-model-len", str(args.prefix_len + args.turns * (
                           args.question_len + args.answer_len) + BLOCK_SIZE),
                       "--max-num-seqs", "64", "--log-level", "warning",
                       "--metrics-port", str(metrics_port)], startup_timeout=600)
    try:
        start = time.perf_counter()
        turns, sent = asyncio.run(run_users(cluster.address, args))
        seconds = time.perf_counter() - start
        per_engine = ttft_counts(metrics_port + 1)
    finally:
        cluster.stop()
    return Run(policy, seconds, turns, per_engine), sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--answer-len", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=0,
                        help="KV cache per engine in tokens; 0: 60%% of the unique tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    per_user = args.turns * (args.question_len + args.answer_len)
    unique = args.groups * args.prefix_len + args.groups * args.users * per_user
    if not args.kv_tokens:
        args.kv_tokens = int(unique * 0.6)
    print(f"{args.groups} groups x {args.users} users x {args.turns} turns; prefix "
          f"{args.prefix_len}, question {args.question_len}, answer {args.answer_len} tokens; "
          f"unique tokens {unique}, KV cache {args.kv_tokens} tokens per engine", flush=True)
    model = bench_checkpoint()
    runs = []
    for policy in args.policies.split(","):
        run, sent = run_policy(policy, model, args)
        runs.append((run, sent))
        print(f"  {policy}: {run.seconds:.1f} s", flush=True)
    print()
    print("| policy | hit rate | oracle (prompts) | oracle (+answers) | of oracle (prompts) "
          "| of oracle (+answers) | TTFT p50 s | TTFT p90 s | output tok/s "
          "| requests per engine | max/mean |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run, sent in runs:
        prompt = sum(t.prompt_tokens for t in run.turns)
        hit = sum(t.cached_tokens for t in run.turns) / prompt
        oracle_prompts, oracle_all = oracle_rates(sent)
        ttfts = sorted(t.ttft_s for t in run.turns)
        p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
        output = sum(t.output_tokens for t in run.turns) / run.seconds
        counts = [run.per_engine.get(k, 0) for k in sorted(run.per_engine)]
        spread = max(counts) / statistics.mean(counts) if counts else float("nan")
        print(f"| {run.policy} | {hit:.3f} | {oracle_prompts:.3f} | {oracle_all:.3f} | "
              f"{hit / oracle_prompts:.2f} | {hit / oracle_all:.2f} | "
              f"{statistics.median(ttfts):.3f} | {p90:.3f} | "
              f"{output:.1f} | {'/'.join(map(str, counts))} | {spread:.2f} |")


if __name__ == "__main__":
    main()
