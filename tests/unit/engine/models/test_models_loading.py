"""What the loader accepts and refuses, and RoPE frequencies against transformers'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from corestream_kernels import cpu_linear
from corestream_kernels.cpu_extension import load as load_cpu_kernels
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.linear import Linear
from services.engine.models.loader import model_class
from services.engine.models.registry import MODEL_REGISTRY
from services.engine.models.rotary_embedding import inverse_frequencies
from tests.unit.engine.hf_checkpoints import make_checkpoint
from tests.unit.engine.runner_driver import make_runner

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "max_position_embeddings": 128}


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_every_registered_architecture_resolves(arch: str) -> None:
    assert model_class([arch]).__name__ == arch


def test_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        model_class(["GPT2LMHeadModel"])


def read(hf_config: Any) -> DecoderConfig:
    arch = type(hf_config).__name__.replace("Config", "ForCausalLM")
    return model_class([arch]).config_from_hf(hf_config.to_dict())


@pytest.mark.parametrize(
    ("hf_config", "window"),
    [
        (LlamaConfig(**SMALL), None),
        (MistralConfig(**SMALL, sliding_window=None), None),
        (MistralConfig(**SMALL, sliding_window=64), 64),
        # Qwen configs carry a window that only use_sliding_window switches on.
        (Qwen2Config(**SMALL, sliding_window=64), None),
        (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=1), 64),
        (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=2),
         None),
        (Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=0), 64),
    ],
)
def test_sliding_window_is_read_per_family(hf_config: Any, window: int | None) -> None:
    assert read(hf_config).sliding_window == window


def test_family_switches() -> None:
    qwen2 = read(Qwen2Config(**SMALL))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = read(Qwen3Config(**SMALL, head_dim=32))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    llama = read(LlamaConfig(**SMALL, attention_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.head_dim) == (True, True, 16)


@pytest.mark.parametrize(
    ("hf_config", "windows"),
    [
        (MistralConfig(**SMALL, sliding_window=64), [64, 64]),
        (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=1),
         [None, 64]),
        (Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=64,
                     layer_types=["sliding_attention", "full_attention"]), [64, None]),
        (Qwen3Config(**SMALL, sliding_window=64,
                     layer_types=["sliding_attention", "full_attention"]), [None, None]),
    ],
)
def test_sliding_layers_are_read_per_family(hf_config: Any, windows: list[int | None]) -> None:
    config = read(hf_config)
    assert [config.layer_window(i) for i in range(config.num_hidden_layers)] == windows


def test_unknown_layer_type_is_refused() -> None:
    config = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64).to_dict()
    config["layer_types"] = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="unsupported: \\['chunked_attention'\\]"):
        model_class(["Qwen2ForCausalLM"]).config_from_hf(config)


def test_a_window_shorter_than_max_model_len_is_served(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "mistral", sliding_window=64)
    runner = make_runner(tmp_path, max_model_len=128)
    assert runner.model_info.max_model_len == 128
    assert [layer.self_attn.sliding_window for layer in runner.model.model.layers] == [64, 64]


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_type_fails_at_load(rope_type: str, tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    edit_config(tmp_path, rope_parameters={"rope_type": rope_type, "factor": 2.0,
                                           "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' is not supported"):
        make_runner(tmp_path)


def test_weights_of_another_family_are_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    edit_config(tmp_path, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="missing .*q_norm.weight"):
        make_runner(tmp_path)


def test_dtype_auto_follows_the_older_torch_dtype_key(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = make_runner(tmp_path, dtype="auto")
    assert runner.dtype == "bfloat16"
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16


ROPE_CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-untruncated-mscale": {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                "original_max_position_embeddings": 32, "mscale": 1.0,
                                "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                              "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_frequencies_match_transformers(case: str, head_dim: int) -> None:
    scaling = {**ROPE_CASES[case], "rope_theta": 10000.0}
    hf_config = LlamaConfig(**SMALL, head_dim=head_dim, rope_parameters=scaling)
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    got, got_factor = inverse_frequencies(head_dim, 10000.0, scaling, 128)
    torch.testing.assert_close(got, want.float())
    assert got_factor == pytest.approx(want_factor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_linear_weights_are_packed_for_onednn_on_cpu(tied: bool, dtype: torch.dtype,
                                                      tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path, "llama", tie_word_embeddings=tied, dtype=dtype)
    model = make_runner(tmp_path, device="cpu", dtype="auto").model
    ops = load_cpu_kernels()
    # The few-row kernel reads the packed bytes where this CPU and build run it.
    panels = ops is not None and ops.panel_linear_supported(dtype)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert "model.layers.0.self_attn.qkv_proj" in linears and "lm_head" in linears
    for name, module in linears.items():
        weight = module.weight
        if tied and name == "lm_head":
            # Shared with the embedding table, whose row lookups want a plain tensor; the
            # head reads panels of its own.
            assert weight is model.model.embed_tokens.weight and not weight.is_mkldnn
            assert (module.panels is not None) == panels, name
        elif cpu_linear.is_panels_only(weight):
            # bfloat16 that oneDNN cannot take, or lays out otherwise (a CPU without bf16
            # dot products): the C++ kernel's panels are the weight.
            assert panels and dtype == torch.bfloat16 and weight.dtype == dtype, name
            assert module.panels is not None, name
        else:
            assert weight.is_mkldnn and weight.dtype == dtype, name
            assert (module.panels is not None) == panels, name
    # The same matrix: the packed layer computes what F.linear does on the HF weight,
    # with few rows (the panel kernel's) and many (oneDNN's).
    down = hf.model.layers[1].mlp.down_proj.weight.detach()
    for rows in (1, 5, 40):
        x = torch.randn(rows, down.shape[1], dtype=dtype)
        got = model.model.layers[1].mlp.down_proj(x)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, down))


@pytest.mark.parametrize("tied", [False, True])
def test_without_onednn_float32_linear_weights_are_stored_column_major(
        tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "can_pack", lambda weight: False)
    hf = make_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    model = make_runner(tmp_path, device="cpu").model
    linears = {name: m.weight for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert "model.layers.0.self_attn.qkv_proj" in linears
    for name, weight in linears.items():
        if tied and name == "lm_head":
            # Shared with the embedding table, whose row lookups want rows.
            assert weight is model.model.embed_tokens.weight
            assert weight.is_contiguous()
        else:
            assert weight.t().is_contiguous() and not weight.is_contiguous(), name
    # Same values, only stored the other way round.
    down = hf.model.layers[1].mlp.down_proj.weight
    assert torch.equal(linears["model.layers.1.mlp.down_proj"], down)


def test_without_onednn_bfloat16_linear_weights_are_panels_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU (or a torch) without oneDNN's bfloat16: the C++ kernel's panels are the only
    # copy of each weight, and the model gives the same logits as transformers' weights.
    monkeypatch.setattr(cpu_linear, "can_pack", lambda weight: False)
    hf = make_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    model = make_runner(tmp_path, device="cpu", dtype="auto").model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if cpu_linear.cpu_ops(torch.empty(0)) is None:
        assert all(m.weight.is_contiguous() and not m.weight.is_mkldnn
                   for m in linears.values())
        return
    down = linears["model.layers.1.mlp.down_proj"]
    assert cpu_linear.is_panels_only(down.weight) and down.panels is not None
    want = hf.model.layers[1].mlp.down_proj.weight
    assert torch.equal(cpu_linear.unpack_panels(down.panels, *want.shape), want)
    x = torch.randn(5, want.shape[1], dtype=torch.bfloat16)
    torch.testing.assert_close(down(x), torch.nn.functional.linear(x, want), rtol=2**-7,
                               atol=1e-3)


def test_loading_a_model_imports_no_dynamo(tmp_path: Path) -> None:
    # torch's random init of a module built on the meta device runs its Python reference
    # ops, whose first use imports dynamo: over a second of every engine's and worker's
    # start, and of its exit. The loader builds every model there and needs no init.
    folder = tmp_path / "llama"
    make_checkpoint(folder, "llama", **SMALL)
    script = ("import sys, torch\n"
              "from services.engine.models.loader import load_model\n"
              f"load_model({str(folder)!r}, dtype=torch.float32, device=torch.device('cpu'), "
              "max_model_len=128)\n"
              "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parents[4])
    assert done.stdout.strip() == "False", done.stdout + done.stderr
