"""The decoder hyperparameters our models read, parsed from a Hugging Face config.json.

One plain dataclass instead of transformers' config classes: the engine must not
import transformers. The fields cover the Llama family and the variations of its
relatives (Mistral's sliding window, Qwen2's q/k/v bias, Qwen3's q/k norms); each
family's model class says which of them its checkpoints use (`config_from_hf`).
Both spellings of RoPE settings are accepted: `rope_theta` + `rope_scaling`
(transformers 4) and `rope_parameters` (transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """May differ from hidden_size // num_attention_heads (Qwen3, Mistral Nemo)."""
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """rope_type plus its parameters; empty for plain RoPE."""
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on the q, k and v projections."""
    o_bias: bool = False
    """Bias on the attention output projection."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE."""
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    """Each token attends to at most this many latest positions (itself included)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        """The Llama reading of a config; families adjust it with `dataclasses.replace`."""
        if isinstance(config.get("text_config"), dict):
            config = {**config, **config["text_config"]}
        heads = int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            max_position_embeddings=int(config["max_position_embeddings"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=str(config.get("hidden_act", "silu")),
        )
