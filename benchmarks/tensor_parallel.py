"""Tensor parallelism on CPU: what TP=2 adds to a step, and TP=1 against TP=2 in process.

    .venv/bin/python benchmarks/tensor_parallel.py [--hidden 1024 --layers 8 --batch 16]

On a random Llama in Hugging Face layout (built with transformers, seeded, written once
to benchmarks/.cache/; heads of 64, half as many KV heads, intermediate 2.75x hidden),
in one run:
1. broadcast: `LeaderChannel.send` of a decode step's arrays (`StepArrays` of B
   sequences of --context tokens) and of its LOGITS call, to one follower process that
   receives every call and acknowledges it, as a rank's collective would; median µs of
   the sends alone and of the round trip.
2. collectives: on a 2-rank gloo TP group (two processes, one thread each), the
   all_reduce of [T, hidden] that the embedding and every layer's two row-parallel
   projections add, and the lm_head's all_gather of [B, vocab/2]; median µs each,
   multiplied out into what TP=2 adds to a decode step of B sequences.
3. throughput: the same prompts, greedy, through `ModelRunner` at TP=1 (one thread)
   and `TensorParallelExecutor` at TP=2 (one thread per rank): the prefill step of
   --batch prompts, then decode tokens/s over --steps steps; medians over --rounds,
   the order alternating by round, and whether both produce the same tokens.
Parts 1 and 2 always run on CPU; --device cuda moves part 3 onto GPUs (TP=2 needs two).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.sequences import Sequences  # noqa: E402
from benchmarks.workload import CACHE  # noqa: E402
from services.common.ports import free_port  # noqa: E402
from services.engine.executor.step_channel import (  # noqa: E402
    CallKind,
    FollowerChannel,
    LeaderChannel,
    read_report,
)
from services.engine.executor.tp_executor import TensorParallelExecutor  # noqa: E402
from services.engine.parallel.tp_group import (  # noqa: E402
    current_tp_group,
    init_tp_group,
    leave_tp_group,
)
from services.engine.worker.config import RunnerConfig  # noqa: E402
from services.engine.worker.model_runner import ModelRunner  # noqa: E402

TP = 2
BLOCK_SIZE = 16
PARTS = ("broadcast", "collectives", "throughput")


# ---- machine and model -----------------------------------------------------------------

def cpu_summary() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                 if line.startswith("Model name")), "unknown")
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        pass
    amx = sorted(f for f in flags if f.startswith("amx"))
    return (f"CPU: {name}, {len(os.sched_getaffinity(0))} usable; "
            f"avx512f {'yes' if 'avx512f' in flags else 'no'}, "
            f"avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, "
            f"amx {' '.join(amx) if amx else 'no'}")


def tp_checkpoint(hidden: int, layers: int, vocab: int) -> Path:
    """A random Llama of the given shape, written once; later calls reuse it."""
    path = CACHE / f"tp-llama-{hidden}x{layers}-v{vocab}"
    if (path / "model.safetensors").exists():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(2, hidden // 64)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 2), intermediate_size=-(-hidden * 11 // 4 // 64) * 64,
        vocab_size=vocab, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(min(10, repeats)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# ---- 1. broadcast ------------------------------------------------------------------------

def decode_arrays(batch: int, context: int) -> dict[str, np.ndarray]:
    """A decode step's `StepArrays` for `batch` sequences of `context` tokens each."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    rng = np.random.default_rng(0)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    positions = np.full(batch, context, dtype=np.int64)
    return {
        "input_ids": rng.integers(3, 32000, batch, dtype=np.int64),
        "positions": positions,
        "slot_mapping": tables[:, -1].astype(np.int64) * BLOCK_SIZE + context % BLOCK_SIZE,
        "block_tables": tables,
        "seq_lens": np.full(batch, context + 1, dtype=np.int32),
        "query_start_loc": np.arange(batch + 1, dtype=np.int32),
    }


def follow(channel: FollowerChannel) -> None:
    """A follower that only receives: every call copied out, then acknowledged."""
    channel.open()
    channel.report(("ready", 0))
    while True:
        try:
            call = channel.receive()
        except EOFError:
            return
        if call.kind == CallKind.STOP:
            return
        channel.conn.send_bytes(b"")


def bench_broadcast(batches: list[int], context: int, repeats: int) -> dict[int, float]:
    """Prints, per decode batch size, the median FORWARD send, LOGITS send and FORWARD
    round trip; returns the two sends' sum per step in µs."""
    channel = LeaderChannel(1)
    process = mp.get_context("spawn").Process(target=follow, args=(channel.follower_end(1),))
    process.start()
    channel.after_start()
    (conn,) = channel.connections
    read_report(conn)  # ("ready", 0)
    channel.attached()
    print(f"\n1. step broadcast to one follower (decode, {context}-token sequences, "
          f"median of {repeats})")
    print(f"{'B':>5} {'bytes':>8} {'FORWARD send':>13} {'LOGITS send':>12} "
          f"{'round trip':>11}   (µs)")
    per_step = {}
    try:
        for batch in batches:
            arrays = decode_arrays(batch, context)
            rows = {"rows": np.arange(batch, dtype=np.int64)}
            sends: dict[str, list[float]] = {"forward": [], "logits": [], "trip": []}
            for i in range(repeats + 10):
                start = time.perf_counter()
                channel.send(CallKind.FORWARD, arrays)
                sent = time.perf_counter()
                conn.recv_bytes()
                acked = time.perf_counter()
                channel.send(CallKind.LOGITS, rows)
                logits = time.perf_counter() - acked
                conn.recv_bytes()
                if i >= 10:  # the first sends map the segment and warm the pipe
                    sends["forward"].append(sent - start)
                    sends["trip"].append(acked - start)
                    sends["logits"].append(logits)
            forward, logits_us, trip = (statistics.median(v) * 1e6 for v in sends.values())
            nbytes = sum(a.nbytes for a in arrays.values())
            print(f"{batch:>5} {nbytes:>8} {forward:>13.1f} {logits_us:>12.1f} {trip:>11.1f}")
            per_step[batch] = forward + logits_us
    finally:
        channel.close()
        process.join(10)
    return per_step


# ---- 2. collectives ----------------------------------------------------------------------

@torch.inference_mode()
def collective_rank(rank: int, port: int, args: argparse.Namespace, batches: list[int],
                    tokens: list[int], results: Any) -> None:
    """Times every collective twice: with this rank pinned to its own share of the CPUs,
    as the executor places its ranks, then free to run on any of them."""
    torch.set_num_threads(1)
    group = init_tp_group(rank, TP, "127.0.0.1", port, timeout_s=120)
    dtype = getattr(torch, args.dtype)
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = len(cpus) // TP
    out: dict[str, dict[int, float]] = {}
    for placement in ("pinned", "free"):
        if placement == "pinned" and per_rank:
            os.sched_setaffinity(0, cpus[rank * per_rank:(rank + 1) * per_rank])
        else:
            os.sched_setaffinity(0, cpus)
        reduces, gathers = out[f"all_reduce {placement}"], out[f"all_gather {placement}"] = {}, {}
        for n in tokens:
            # Zeros: the in-place sums of random values would overflow over the repeats.
            x = torch.zeros(n, args.hidden, dtype=dtype)
            reduces[n] = median_us(lambda x=x: group.all_reduce(x), args.repeats)
            if n in batches:  # only the sampled rows' logits are gathered
                logits = torch.zeros(n, -(-args.vocab // TP), dtype=dtype)
                gathers[n] = median_us(lambda t=logits: group.all_gather(t), args.repeats)
    leave_tp_group()
    if rank == 0:
        results.put(out)


def bench_collectives(args: argparse.Namespace, batches: list[int],
                      prefill_tokens: int) -> dict[str, dict[int, float]]:
    tokens = sorted({*batches, prefill_tokens})
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(collective_rank, args=(free_port(), args, batches, tokens, results), nprocs=TP,
             join=True)
    out = results.get()
    print(f"\n2. collectives on a {TP}-rank gloo group, one thread per rank, {args.dtype}, "
          f"median of {args.repeats}; pinned: each rank on its own CPUs, as the executor "
          f"places them; free: on any")
    print(f"{'':5} {'all_reduce [T, ' + str(args.hidden) + ']':>21} "
          f"{'all_gather [T, ' + str(-(-args.vocab // TP)) + ']':>21}")
    print(f"{'T':>5} {'pinned':>10} {'free':>10} {'pinned':>10} {'free':>10}   (µs)")
    for n in tokens:  # the prefill's T has no all_gather: only its B rows are gathered
        cells = (out[f"{op} {where}"].get(n) for op in ("all_reduce", "all_gather")
                 for where in ("pinned", "free"))
        print(f"{n:>5} " + " ".join(f"{'-':>10}" if us is None else f"{us:>10.1f}"
                                    for us in cells))
    return out


def tp_cost_ms(args: argparse.Namespace, collectives: dict[str, dict[int, float]],
               broadcast: dict[int, float], batch: int, tokens: int,
               placement: str = "pinned") -> float:
    """What TP=2 adds to a step of `tokens` tokens of which `batch` are sampled: the
    embedding's all_reduce, two per layer, the logits' all_gather, the two sends."""
    reduces = (2 * args.layers + 1) * collectives[f"all_reduce {placement}"][tokens]
    gather = collectives[f"all_gather {placement}"][batch]
    return (reduces + gather + broadcast.get(batch, 0.0)) / 1e3


# ---- 3. throughput -----------------------------------------------------------------------

class CollectiveClock:
    """Seconds this process spends inside the TP group's collectives, waiting for the
    other rank included: the methods are wrapped on the group object that the model's
    layers hold."""

    def __init__(self, group: Any) -> None:
        self.seconds = 0.0
        for name in ("all_reduce", "all_gather"):
            setattr(group, name, self._timed(getattr(group, name)))

    def _timed(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
        def timed(tensor: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return fn(tensor)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def run_once(executor: Any, prompts: list[list[int]], steps: int, tag: str,
             clock: CollectiveClock | None) -> tuple[float, float, float, list[list[int]]]:
    """Prefill seconds; decode seconds per step, and of those, seconds in collectives;
    the tokens made."""
    seqs = Sequences(executor, prompts, len(prompts[0]) + steps + 1, tag)
    start = time.perf_counter()
    seqs.prefill()
    prefill = time.perf_counter() - start
    in_collectives = clock.seconds if clock else 0.0
    start = time.perf_counter()
    for _ in range(steps):
        seqs.decode()
    decode = (time.perf_counter() - start) / steps
    in_collectives = ((clock.seconds if clock else 0.0) - in_collectives) / steps
    return prefill, decode, in_collectives, seqs.finish()


def bench_throughput(args: argparse.Namespace, model: Path) -> dict[str, float]:
    prompt_len = args.prompt_len
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.batch, prompt_len), generator=gen).tolist()
    config = RunnerConfig(model=str(model), dtype=args.dtype, device=args.device,
                          block_size=BLOCK_SIZE, kv_cache_memory=args.kv_cache_memory,
                          max_model_len=prompt_len + args.steps + BLOCK_SIZE, num_threads=1)
    # TP=1 first: the loader shards by the process's current TP group, which the
    # executor makes.
    executors: dict[str, Any] = {"TP=1": ModelRunner(config)}
    executors["TP=2"] = TensorParallelExecutor(
        dataclasses.replace(config, num_threads=TP, tensor_parallel_size=TP), TP,
        log_level="warning")
    clocks = {"TP=1": None, "TP=2": CollectiveClock(current_tp_group())}
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in executors}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for executor in executors.values():
            executor.warmup()
        executors["TP=1"].settle()  # (TP=2's ranks move theirs in their own processes)
        for r in range(args.rounds):
            order = list(executors) if r % 2 == 0 else list(reversed(executors))
            for name in order:
                *times, made = run_once(executors[name], prompts, args.steps,
                                        f"{name}-{r}-", clocks[name])
                samples[name].append(tuple(times))
                tokens.setdefault(name, made)
    finally:
        executors["TP=2"].close()
    on_cpu = executors["TP=1"].device.startswith("cpu")
    print(f"\n3. in process, {args.batch} prompts of {prompt_len} tokens, then {args.steps} "
          f"greedy decode steps; {args.dtype} on {executors['TP=1'].device}, medians of "
          f"{args.rounds} rounds")
    if on_cpu:
        print(f"   NOTE: TP=1 runs one thread on one core; TP=2 runs one thread per rank, so "
              f"it uses {TP} cores" + (" (all of this machine's)"
                                       if len(os.sched_getaffinity(0)) <= TP else ""))
    else:
        print(f"   TP=1 runs on one GPU, TP=2 on {TP} (cuda:0 and cuda:1)")
    print(f"{'':6} {'prefill ms':>11} {'decode ms/step':>15} {'decode tok/s':>13} "
          f"{'in collectives ms/step':>23}")
    medians = {}
    for name, rows in samples.items():
        prefill, decode, waits = (statistics.median(column) * 1e3
                                  for column in zip(*rows, strict=True))
        medians.update({name: decode, f"{name} prefill": prefill, f"{name} waits": waits})
        print(f"{name:6} {prefill:>11.1f} {decode:>15.2f} {args.batch / decode * 1e3:>13.1f} "
              f"{waits:>23.2f}")
    one, two = medians["TP=1"], medians["TP=2"]
    print(f"TP2/TP1: decode tok/s {one / two:.2f}x, prefill speed "
          f"{medians['TP=1 prefill'] / medians['TP=2 prefill']:.2f}x")
    differ = [i for i, (a, b) in enumerate(zip(tokens["TP=1"], tokens["TP=2"], strict=True))
              if a != b]
    if differ:
        first = tokens["TP=1"][differ[0]]
        step = next(i for i, (a, b) in enumerate(zip(first, tokens["TP=2"][differ[0]],
                                                     strict=True)) if a != b)
        print(f"greedy tokens identical: NO ({len(differ)} of {args.batch} sequences differ; "
              f"sequence {differ[0]} first at token {step})")
    else:
        print(f"greedy tokens identical: yes ({args.batch} sequences x {args.steps + 1} tokens)")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=16, help="sequences in part 3")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where part 3 runs (cuda: TP=2 over GPUs 0 and 1)")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64, 256],
                        help="decode batch sizes of parts 1 and 2")
    parser.add_argument("--context", type=int, default=512,
                        help="tokens per sequence in part 1's block tables")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls in parts 1, 2")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")

    print(cpu_summary())
    print(f"torch {torch.__version__}; model: hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}, {args.dtype}")
    model = tp_checkpoint(args.hidden, args.layers, args.vocab)
    batches = sorted(set(args.decode_batches) | {args.batch})
    broadcast = bench_broadcast(batches, args.context, args.repeats) if "broadcast" in parts \
        else {}
    collectives = None
    if "collectives" in parts:
        collectives = bench_collectives(args, batches, args.batch * args.prompt_len)
        print(f"what TP={TP} adds per step ({2 * args.layers + 1} all_reduces, 1 all_gather"
              + (", the FORWARD and LOGITS sends" if broadcast else "")
              + "), ranks pinned (free):")
        for b in batches:
            pinned, free = (tp_cost_ms(args, collectives, broadcast, b, b, where)
                            for where in ("pinned", "free"))
            print(f"  TP adds ~{pinned:.2f} ms ({free:.2f}) per decode step of {b} sequences")
        prefill_tokens = args.batch * args.prompt_len
        pinned, free = (tp_cost_ms(args, collectives, {}, args.batch, prefill_tokens, where)
                        for where in ("pinned", "free"))
        print(f"  TP adds ~{pinned:.2f} ms ({free:.2f}) to the prefill step of {args.batch} x "
              f"{args.prompt_len} tokens (collectives only)")
    if "throughput" in parts:
        medians = bench_throughput(args, model)
        if collectives is not None and args.device == "cpu":
            extra = medians["TP=2"] - medians["TP=1"] / TP
            estimate = tp_cost_ms(args, collectives, broadcast, args.batch, args.batch)
            print(f"TP=2 decode step minus half the TP=1 step: {extra:.2f} ms. Rank 0 spends "
                  f"{medians['TP=2 waits']:.2f} ms of its step inside collectives, waiting for "
                  f"rank 1 included; parts 1-2 put the collectives and sends alone at "
                  f"{estimate:.2f} ms (B={args.batch}, ranks pinned)")


if __name__ == "__main__":
    main()
