"""Build a model from a Hugging Face checkpoint folder: config.json + safetensors shards.

The model is constructed on the meta device and its parameters are replaced by the
checkpoint tensors (`assign=True`), so weights are never allocated twice. The
architecture named in config.json picks the class through `MODEL_REGISTRY`, which
names modules rather than importing them, so adding Mistral or Qwen2 is one line
plus a module.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.engine.models.decoder_config import DecoderConfig

logger = logging.getLogger(__name__)

# Architecture in config.json -> "module:class".
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "services.engine.models.llama:LlamaForCausalLM",
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def model_class(architectures: list[str]) -> type[nn.Module]:
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            module_name, class_name = MODEL_REGISTRY[arch].split(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"no supported architecture among {architectures}; supported: {sorted(MODEL_REGISTRY)}"
    )


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The checkpoint's model in eval mode, with weights in `dtype` on `device`."""
    folder = Path(path)
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = DecoderConfig.from_hf(hf_config)
    cls = model_class(list(hf_config.get("architectures") or []))
    with torch.device("meta"):
        model = cls(config)

    state = _read_safetensors(folder, dtype, device)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {folder} does not fit {cls.__name__}: "
            f"missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}"
        )
    model.tie_weights()
    logger.info("loaded %s (%s) from %s onto %s as %s", cls.__name__,
                ", ".join(hf_config.get("architectures", [])), folder, device, dtype)
    return model.eval()


def _read_safetensors(
    folder: Path, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                # Precomputed RoPE tables in old checkpoints; ours are derived from config.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor.to(device)
    return state
