"""The decoder hyperparameters our models read, parsed from a Hugging Face config.json.

One plain dataclass instead of transformers' config classes: the engine must not
import transformers. The fields cover the Llama family and the variations of its
relatives (Mistral's sliding window, Qwen2's q/k/v bias, Qwen3's q/k norms); each
family's model class says which of them its checkpoints use (`config_from_hf`).
Mixture-of-experts families add a `MoEConfig` (`moe`), which dense models leave unset.
Both spellings of RoPE settings are accepted: `rope_theta` + `rope_scaling`
(transformers 4) and `rope_parameters` (transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The sparse mixture-of-experts MLP that replaces the dense one in `sparse_layers`."""

    num_experts: int
    num_experts_per_tok: int
    """Experts each token is routed to (top-k)."""
    intermediate_size: int
    """Of one expert; dense layers keep DecoderConfig.intermediate_size."""
    sparse_layers: tuple[int, ...]
    """Indices of the layers whose MLP is sparse."""
    norm_topk_prob: bool = False
    """Renormalize the top-k routing probabilities to sum to 1 (Mixtral always does)."""
    shared_expert_intermediate_size: int = 0
    """A dense expert every token also passes through, gated by a sigmoid; 0 = none."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts {self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.intermediate_size < 1 or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"expert intermediate sizes must be positive, got {self.intermediate_size} "
                f"and shared {self.shared_expert_intermediate_size}"
            )

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], intermediate_size_key: str, norm_topk_prob: bool | None
    ) -> MoEConfig:
        """The experts of a config.json; `norm_topk_prob` None reads the config's switch.

        Qwen-style configs make every `decoder_sparse_step`-th layer sparse except those in
        `mlp_only_layers`; Mixtral's have neither key, so all its layers are sparse.
        """
        num_layers = int(config["num_hidden_layers"])
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        return cls(
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            intermediate_size=int(config[intermediate_size_key]),
            sparse_layers=tuple(
                i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
            ),
            norm_topk_prob=(
                bool(config.get("norm_topk_prob", False))
                if norm_topk_prob is None
                else norm_topk_prob
            ),
            shared_expert_intermediate_size=int(
                config.get("shared_expert_intermediate_size") or 0
            ),
        )


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
    sliding_layers: tuple[int, ...] | None = None
    """The layers that attend through `sliding_window`; None: every layer."""
    moe: MoEConfig | None = None
    """The mixture-of-experts MLP; None for dense models."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None and any(
            not 0 <= i < self.num_hidden_layers for i in self.sliding_layers
        ):
            raise ValueError(
                f"sliding_layers {self.sliding_layers} name layers outside "
                f"[0, {self.num_hidden_layers})"
            )
        if self.moe is not None and any(
            not 0 <= i < self.num_hidden_layers for i in self.moe.sparse_layers
        ):
            raise ValueError(
                f"moe.sparse_layers {self.moe.sparse_layers} name layers outside "
                f"[0, {self.num_hidden_layers})"
            )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None where it attends over everything."""
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

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
