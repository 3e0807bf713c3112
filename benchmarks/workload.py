"""The benchmark checkpoint and workloads shared by the benchmark scripts.

The checkpoint is a random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV
heads, intermediate 1408, vocabulary 4096, fp32) in Hugging Face layout, built
with transformers and seeded, with a word-level tokenizer ("w0".."w4095") so the
frontend can detokenize whatever the model produces.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
VOCAB = 4096


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


def chunk_timings(start: float, arrivals: list[tuple[float, int]]
                  ) -> tuple[float, list[float]]:
    """One stream's time to first token and inter-token gaps from its chunks' (arrival
    time, tokens). A later chunk of n tokens counts as n gaps of its wait / n, so that a
    server that batches tokens into chunks neither gains nor loses by it; the first
    chunk's extra tokens count as none (they came with the first token)."""
    gaps: list[float] = []
    for (before, _), (now, n) in zip(arrivals, arrivals[1:], strict=False):
        gaps += [(now - before) / n] * n
    return arrivals[0][0] - start, gaps


# SmolLM2-135M-Instruct's shapes (its config.json): a real model's proportions, with a
# 49,152-word vocabulary whose tied head is a fifth of every decode step's bytes.
SMOLLM2_SHAPES = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
BENCH_SHAPES = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1408, vocab_size=VOCAB, tie_word_embeddings=False,
)


def bench_checkpoint(path: Path = CACHE / "bench-llama-512x8",
                     shapes: dict[str, object] = BENCH_SHAPES) -> Path:
    """Write the benchmark checkpoint once (random weights, seeded); later calls reuse it."""
    if (path / "model.safetensors").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         torch_dtype="float32", **shapes)
    model = LlamaForCausalLM(config).eval()
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    _write_tokenizer(tmp, int(shapes["vocab_size"]))
    tmp.rename(path)
    return path


def smollm2_shaped_checkpoint() -> Path:
    """Random weights in SmolLM2-135M's shapes (float32, tied embeddings)."""
    return bench_checkpoint(CACHE / "bench-smollm2-shapes", SMOLLM2_SHAPES)


def _write_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))


def fixed_logits_checkpoint(path: Path = CACHE / "fixed-logits",
                            step_seconds: float = 0.0) -> Path:
    """A checkpoint of services/engine/models/fixed_logits.py: the model costs nothing
    (or, with `step_seconds`, sleeps that long per step and costs no CPU)."""
    if step_seconds:
        path = path.with_name(f"{path.name}-{step_seconds * 1000:g}ms")
    if (path / "model.safetensors").exists():
        return path
    import numpy as np
    from safetensors.numpy import save_file

    tmp = path.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["CorestreamFixedLogitsForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
        "vocab_size": VOCAB, "max_position_embeddings": 2048, "bos_token_id": 1,
        "eos_token_id": 2, "dtype": "float32",
    }
    if step_seconds:
        config["corestream_step_seconds"] = step_seconds
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    save_file({"logits": logits}, str(tmp / "model.safetensors"))
    _write_tokenizer(tmp)
    tmp.rename(path)
    return path


def mixed_workload(num_requests: int = 128, seed: int = 0) -> list[BenchRequest]:
    """Prompt lengths 16-512, output lengths 16-256, random token ids."""
    rng = random.Random(seed)
    return [
        BenchRequest(
            prompt=[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 512))],
            max_tokens=rng.randint(16, 256),
        )
        for _ in range(num_requests)
    ]


def fresh_prompts(batch: list[BenchRequest], seed: int) -> list[BenchRequest]:
    """The same lengths with new random token ids: a second run of one workload that
    no prefix cache filled by the first can serve."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, VOCAB) for _ in r.prompt], r.max_tokens)
            for r in batch]


def warmup_workload(num_requests: int = 8) -> list[BenchRequest]:
    """Other prompts (another seed), so that no prefix-cache hit flatters the timed run."""
    return [BenchRequest(r.prompt, min(r.max_tokens, 32))
            for r in mixed_workload(num_requests, seed=12345)]


def mixtral_checkpoint(folder: Path) -> Path:
    """A random 4-layer Mixtral (4 experts, top 2, hidden 256) with the tiny checkpoint's
    tokenizer, written into `folder`: the expert-parallel benchmarks' model."""
    import shutil

    from services.common.tiny_checkpoint import ensure_tiny_checkpoint
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    tiny = ensure_tiny_checkpoint()
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    make_checkpoint(folder, "mixtral", vocab_size=vocab, num_local_experts=4,
                    num_experts_per_tok=2, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, folder / name)
    return folder
