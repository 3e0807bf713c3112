"""`--quantization int8`: a safetensors checkpoint's linear weights quantized at load,
one scale per output channel, multiplied by the same kernels as GGUF's Q8_0 blocks.

The reference is transformers on the same float weights: the int8 model's logits stay
within the error that rounding the weights to 8 bits allows, and its greedy tokens are
transformers' (this checkpoint's margins are wide enough; measured below)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from corestream_kernels.quant import GGMLType, dequantize, ungroup_rows

from services.common.gguf_checkpoint import ensure_gguf_view
from services.engine.models.linear import QuantizedLinear
from services.engine.models.loader import load_model
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import VOCAB, hf_greedy, hf_logits, make_checkpoint
from tests.unit.engine.runner_driver import GREEDY, all_logits, generate, random_prompts

pytest.importorskip("transformers")

NUM_TOKENS = 12
# Relative error of the last position's logits against transformers' float32 ones.
# Measured: 0.024 at 9 rows, 0.040 at 40 (the largest over their positions).
MAX_LOGITS_ERROR = 0.06


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("llama")
    # Rows of whole blocks of 32 (make_checkpoint's default 172 is not).
    model = make_checkpoint(folder, "llama", intermediate_size=192, tie_word_embeddings=True)
    return folder, model


def runner(folder: Path, quantization: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=str(folder), dtype="float32", device="cpu",
                                    block_size=4, kv_cache_memory=4 << 20,
                                    max_model_len=128, quantization=quantization))


def test_linear_layers_hold_int8_per_output_channel(checkpoint: tuple[Path, Any]) -> None:
    folder, hf_model = checkpoint
    model = load_model(folder, torch.float32, torch.device("cpu"), 128, "int8")
    theirs = hf_model.state_dict()
    layer = model.model.layers[0]
    for module, names in [(layer.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"]),
                          (layer.mlp.down_proj, ["down_proj"])]:
        assert isinstance(module, QuantizedLinear)
        assert module.weight.ggml_type == GGMLType.Q8_0
        prefix = "model.layers.0." + ("self_attn." if len(names) == 3 else "mlp.")
        float_weight = torch.cat([theirs[prefix + n + ".weight"] for n in names])
        blocks = ungroup_rows(module.weight).blocks.view(module.out_features, -1, 34)
        scales = blocks[..., :2].contiguous().view(torch.float16)
        assert torch.equal(scales, scales[:, :1].expand_as(scales))  # one per row
        step = float_weight.abs().amax(1, keepdim=True) / 127
        error = (dequantize(module.weight) - float_weight).abs()
        assert bool((error <= 0.51 * step).all())
    # The tied head multiplies by an int8 copy; the lookup table stays float.
    assert isinstance(model.lm_head, QuantizedLinear)
    assert torch.equal(model.model.embed_tokens.weight, theirs["model.embed_tokens.weight"])


def test_logits_and_greedy_tokens_follow_transformers(checkpoint: tuple[Path, Any]) -> None:
    folder, hf_model = checkpoint
    # 9 rows: the few-row GEMV (activations quantized); 40: the prefill's float GEMM.
    prompts = random_prompts({"a": 9, "b": 40}, VOCAB)
    int8 = runner(folder, "int8")
    for i, (rid, prompt) in enumerate(prompts.items()):
        blocks = list(range(32 * i, 32 * (i + 1)))
        ours = all_logits(int8, [ScheduledRequest(rid, prompt, 0, blocks, True, GREEDY,
                                                  prompt, [])])
        theirs = hf_logits(hf_model, prompt)
        error = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
        print(f"{rid}: {len(prompt)} rows, logits' relative error {error:.4f}")
        assert error < MAX_LOGITS_ERROR
    tokens = generate(int8, prompts, NUM_TOKENS)
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(hf_model, prompt, NUM_TOKENS), rid


def test_refused_with_gguf_and_tensor_parallelism(smollm2_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF file, served with its own quantization"):
        load_model(ensure_gguf_view(smollm2_gguf, tmp_path), torch.float32,
                   torch.device("cpu"), 128, "int8")
    with pytest.raises(ValueError, match="not served with tensor parallelism"):
        RunnerConfig(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be one of"):
        RunnerConfig(quantization="int4")
