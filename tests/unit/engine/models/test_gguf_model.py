"""The engine on a real GGUF file (SmolLM2-135M-Instruct Q4_1) against transformers.

The reference is transformers' own GGUF reading, loaded into transformers' Llama in
float32 (`tests.gguf_models.transformers_model`). Both sides read the same blocks:
dequantized, ours equal theirs bit for bit. Our linear layers keep the blocks and, at
decode, quantize the activations to 8 bits in two passes (`corestream_kernels.quant.quant_linear`;
a decode step runs them all in one C++ call, with the same bits as the Python layers), so
decoded tokens are compared teacher-forced (the issue's bar: top-1 agreement; over 20
prompts in test_gguf_vs_llama_cpp.py) rather than equal, while prefill (which dequantizes
each layer for the call) matches their logits closely.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from corestream_kernels.cpu_extension import cpu_ops
from corestream_kernels.quant import (
    GGMLType,
    QuantizedWeight,
    dequantize,
    quantize_q4_1,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q8_0,
)
from tokenizers import Tokenizer

from services.common.gguf_checkpoint import ensure_gguf_view
from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.gguf_weights import read_gguf
from services.engine.models.linear import (
    MixedQuantizedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    has_quantized_layers,
)
from services.engine.models.loader import DEQUANTIZE_ENV, load_model, pack_projections
from services.engine.models.tp_sharding import ShardPlan
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.gguf_models import transformers_model
from tests.kernels.decoder_driver import DecodeCalls, decode_logits
from tests.unit.engine.runner_driver import GREEDY, all_logits, generate

pytest.importorskip("transformers.modeling_gguf_pytorch_utils")

QUESTIONS = {
    "france": "What is the capital of France?",
    "math": "What is 2 + 2?",
    "sky": "Why is the sky blue? Answer in one sentence.",
}
NUM_TOKENS = 16
# Decode steps whose logits the one-call op and the Python layers must give alike.
DECODE_STEPS = 4
# The issue's bar for the weights' resident bytes, against the file's size.
MAX_WEIGHT_BYTES_PER_FILE_BYTE = 1.3
# Ours quantizes the activations of the Q4_1/Q8_0 projections to two 8-bit passes (about
# 15 bits) at every row count (kernels/corestream_kernels/csrc/quant_groups.h); transformers
# multiplies the
# dequantized weights in float32. Measured: at most 9.5e-3 over these prompts' logits,
# which reach 38 in magnitude (1.2e-4 when the prefill multiplied float activations; one
# 8-bit pass, as llama.cpp's, errs by about 100x more). That with a float32 KV cache; with
# the float16 one that `auto` gives a GGUF file (as llama.cpp's default), at most 0.051.
LOGITS_ATOL = {"float32": 2e-2, "float16": 1e-1}


@pytest.fixture(scope="module")
def view(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_gguf_view(smollm2_gguf, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf: Path) -> Any:
    return transformers_model(smollm2_gguf)


@pytest.fixture(scope="module")
def runner(view: Path) -> ModelRunner:
    return make_smollm2_runner(view)


def make_smollm2_runner(view: Path, kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(RunnerConfig(
        model=str(view), dtype="float32", device="cpu", block_size=16,
        kv_cache_memory=64 << 20, max_model_len=128, kv_cache_dtype=kv_cache_dtype,
    ))


@pytest.fixture(scope="module")
def prompts(view: Path) -> dict[str, list[int]]:
    """Each question as the chat template frames it, with the assistant's turn open."""
    tokenizer = Tokenizer.from_file(str(view / "tokenizer.json"))
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return {
        name: tokenizer.encode(
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n").ids
        for name, question in QUESTIONS.items()
    }


def test_weights_equal_transformers(view: Path, hf_model: Any, smollm2_gguf: Path) -> None:
    ours = read_gguf(smollm2_gguf, "llama", torch.float32, torch.device("cpu"))
    theirs = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_layers_hold_the_files_blocks(runner: ModelRunner, hf_model: Any,
                                      smollm2_gguf: Path) -> None:
    model = runner.model
    theirs = hf_model.state_dict()
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantizedLinear)
    assert attn.qkv_proj.weight.ggml_type.name == "Q4_1"
    # Fused from the q, k and v blocks; dequantized, bit for bit transformers' tensors.
    qkv = torch.cat([theirs[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(dequantize(attn.qkv_proj.weight), qkv)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantizedLinear)
    assert torch.equal(dequantize(down.weight), theirs["model.layers.0.mlp.down_proj.weight"])
    # The tied head multiplies by the embedding table's own (Q8_0) blocks.
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(model.lm_head,
                                                                    QuantizedLinear)
    assert model.lm_head.weight is embedding.weight
    assert embedding.weight.ggml_type.name == "Q8_0"
    table = theirs["model.embed_tokens.weight"]
    assert torch.equal(dequantize(embedding.weight), table)
    ids = torch.tensor([0, 17, 49151, 17])
    assert torch.equal(embedding(ids), table[ids])
    # Resident weight bytes (each storage once: the head shares the table's).
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]
                if not any(t is b for b in model.model.rotary_emb.buffers())}
    weight_bytes = sum(storages.values())
    file_bytes = smollm2_gguf.stat().st_size
    print(f"weights {weight_bytes / 2**20:.1f} MiB for a {file_bytes / 2**20:.1f} MiB file "
          f"({weight_bytes / file_bytes:.3f}x)")
    assert weight_bytes <= MAX_WEIGHT_BYTES_PER_FILE_BYTE * file_bytes


def test_decode_steps_are_one_call_with_the_per_layer_paths_bits(
        runner: ModelRunner, prompts: dict[str, list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step runs every quantized layer and the tied head in one C++ call
    (`decode_model`), with the bits of the Python layers' quant_linear per projection:
    the same logits, and the same greedy tokens from the op's own argmax."""
    if cpu_ops(torch.empty(0)) is None:
        pytest.skip("the CPU kernels are not built here")
    assert runner.model.model.decode_op(runner.model.lm_head) is not None
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, DECODE_STEPS, "py-")
    python_tokens = generate(runner, prompts, NUM_TOKENS)
    fused = DecodeCalls(monkeypatch, enabled=True)
    got = decode_logits(runner, prompts, DECODE_STEPS, "cpp-")
    assert fused.count == DECODE_STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"
    assert generate(runner, prompts, NUM_TOKENS) == python_tokens
    assert fused.count == DECODE_STEPS + NUM_TOKENS - 1  # every decode step


def test_greedy_tokens_do_not_depend_on_prefill_chunking(
        runner: ModelRunner, prompts: dict[str, list[int]], view: Path) -> None:
    # The last rows of each prompt in a step of their own (as after a prefix-cache hit):
    # they go through the few-row GEMV, the rest through the prefill's GEMM. With one
    # 8-bit pass over the activations the France prompt's first token flipped.
    whole = generate(runner, prompts, NUM_TOKENS)
    tail = generate(runner, prompts, NUM_TOKENS,
                    first_chunk={name: len(prompt) - 4 for name, prompt in prompts.items()})
    assert tail == whole
    tokenizer = Tokenizer.from_file(str(view / "tokenizer.json"))
    assert "Paris" in tokenizer.decode(whole["france"])


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_prefill_logits_match_transformers(runner: ModelRunner, view: Path, hf_model: Any,
                                           prompts: dict[str, list[int]],
                                           kv_cache_dtype: str) -> None:
    # The module's runner has auto's float16 cache; the float32 one shows the kernels' own
    # error apart from the cache's rounding.
    assert runner.kv_caches[0].dtype == torch.float16
    if kv_cache_dtype == "float32":
        runner = make_smollm2_runner(view, kv_cache_dtype)
    per_request = runner.model_info.max_model_len // runner.block_size
    requests = [
        ScheduledRequest(name, prompt, 0, list(range(i * per_request, (i + 1) * per_request)),
                         True, GREEDY, prompt, [])
        for i, (name, prompt) in enumerate(prompts.items())
    ]
    ours = all_logits(runner, requests)
    with torch.inference_mode():
        theirs = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts.values()])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGITS_ATOL[kv_cache_dtype])


def test_tensor_parallel_refuses_quantized_weights(view: Path, smollm2_gguf: Path) -> None:
    config = DecoderConfig.from_hf(json.loads((view / "config.json").read_text()))
    with pytest.raises(ValueError, match="tensor parallelism"):
        read_gguf(smollm2_gguf, "llama", torch.float32, torch.device("cpu"),
                  plan=ShardPlan(config, 0, 3), keep_quantized=lambda name: True)


def test_packing_concatenates_blocks_of_one_type_and_keeps_mixed_ones_apart() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(64, 64), torch.randn(32, 64)
    same = {"l.q_proj.weight": quantize_q4_1(q), "l.k_proj.weight": quantize_q4_1(k)}
    pack_projections(same, {"qk_proj": ("q_proj", "k_proj")})
    fused = same["l.qk_proj.weight"]
    assert isinstance(fused, QuantizedWeight) and fused.shape == (96, 64)
    assert torch.equal(dequantize(fused),
                       torch.cat([dequantize(quantize_q4_1(q)), dequantize(quantize_q4_1(k))]))
    # A Q4_K_M file's q and k in Q5_0, v in Q8_0: widened to Q8_0 exactly, one weight.
    widened = {"l.q_proj.weight": quantize_q5_0(q), "l.k_proj.weight": quantize_q8_0(k)}
    pack_projections(widened, {"qk_proj": ("q_proj", "k_proj")}, torch.bfloat16)
    fused = widened["l.qk_proj.weight"]
    assert isinstance(fused, QuantizedWeight) and fused.ggml_type == GGMLType.Q8_0
    assert torch.equal(dequantize(fused),
                       torch.cat([dequantize(quantize_q5_0(q)), dequantize(quantize_q8_0(k))]))
    # Types Q8_0 cannot hold exactly (a min, 6-bit scales): each part keeps its blocks.
    mixed = {"l.q_proj.weight": quantize_q5_1(q), "l.k_proj.weight": quantize_q8_0(k)}
    pack_projections(mixed, {"qk_proj": ("q_proj", "k_proj")}, torch.bfloat16)
    parts = mixed["l.qk_proj.weight"]
    assert isinstance(parts, list) and [p.ggml_type.name for p in parts] == ["Q5_1", "Q8_0"]
    layer = MixedQuantizedLinear(parts, None)
    x = torch.randn(3, 64)
    want = x @ torch.cat([dequantize(p) for p in parts]).T
    torch.testing.assert_close(layer(x), want, rtol=0, atol=2e-3)  # outputs ~8; 2e-5 error
    # Float parts come read in the model's dtype.
    with_float = {"l.q_proj.weight": quantize_q4_1(q), "l.k_proj.weight": k.bfloat16()}
    pack_projections(with_float, {"qk_proj": ("q_proj", "k_proj")}, torch.bfloat16)
    dense = with_float["l.qk_proj.weight"]
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16
    assert torch.equal(dense, torch.cat([dequantize(quantize_q4_1(q)).bfloat16(),
                                         k.bfloat16()]))


def test_switch_dequantizes_as_before(view: Path, hf_model: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEQUANTIZE_ENV, "1")
    model = load_model(view, torch.float32, torch.device("cpu"), 128)
    assert not has_quantized_layers(model)
    assert not isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert torch.equal(model.model.embed_tokens.weight,
                       hf_model.state_dict()["model.embed_tokens.weight"])
