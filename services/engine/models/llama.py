"""Llama-family decoder over a paged KV cache: Llama 2/3 here, and through
`DecoderConfig` flags also Mistral, Qwen2 and Qwen3 (see their modules).

Module and parameter names mirror Hugging Face's, so checkpoint tensors load by
name, except that q/k/v and gate/up each run as one matmul: the loader concatenates
the checkpoint's tensors into `qkv_proj` and `gate_up_proj` (`packed_projections`).
The forward pass takes one flattened batch of every scheduled sequence
(tokens `[T]`), writes each layer's new keys and values into that layer's cache
and attends over the cache, so prompts, prompt chunks and decodes share one pass.

The glue between the matmuls comes from `kernels` (one C++ op each on CPU): each
residual add is deferred into the norm after it (`add_rms_norm`), so layers pass on
(output, residual stream) pairs; the rotation of q and k and the KV-cache write are one
call (`rotate_and_store_kv`); gate and up meet in `silu_and_mul`.

On CPU, a step in which every sequence decodes one token skips the Python model: one C++
op runs the embedding, every layer and the final norm
(`corestream_kernels.decoder_layers`), with the
same ops in the same order, so the outputs are the same bits, also where a GGUF file's
layers keep their quantized blocks (`QuantizedLinear`, `QuantizedEmbedding`); prefills,
and mixture-of-experts layers, run the code below.

Under tensor parallelism (a current TP group of more than one rank, `current_tp_group`)
the model is built from `tp_layers`: this rank's query and KV heads, its share of the
MLP, its slice of the vocabulary, and an all-reduce after o_proj and after down_proj.
The C++ decode op cannot all-reduce between layers, so such a model always runs the
Python layers. Without a group, the modules and paths are exactly the unsharded ones.

NOTE: inside a decoder layer, submodules are called through `.forward`, not
`__call__`: nn.Module's hook dispatch costs about as much as a small op, and a step
makes some 70 such calls, which shows in a single-stream decode step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from corestream_kernels.activation import silu_and_mul
from corestream_kernels.backend import get_backend
from corestream_kernels.decoder_layers import (
    ABSENT,
    DecodeModel,
    cpu_decode_model,
    flat_weights,
    quant_format,
)
from corestream_kernels.paged_attention import paged_attention
from corestream_kernels.rms_norm import add_rms_norm, rms_norm
from corestream_kernels.rotary import rotate_and_store_kv
from torch import nn

from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.linear import (
    Linear,
    MixedQuantizedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    has_quantized_layers,
)
from services.engine.models.rotary_embedding import RotaryEmbedding
from services.engine.models.tp_layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    kv_heads_of_rank,
    row_linear,
    sharding_group,
    split_evenly,
)
from services.engine.parallel.tp_group import TPGroup, current_tp_group

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x and residual may be overwritten."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int, tp: TPGroup | None = None) -> None:
        """`tp`: the group this layer's heads are split over (None: all heads here)."""
        super().__init__()
        # Mistral slides every layer, Qwen2/3 may slide only some (see DecoderConfig).
        self.sliding_window = config.layer_window(layer)
        # This rank's heads: all of them without a group.
        world, rank = (tp.world_size, tp.rank) if tp is not None else (1, 0)
        self.num_heads = split_evenly(config.num_attention_heads, world, "num_attention_heads")
        self.num_kv_heads = len(kv_heads_of_rank(config.num_key_value_heads, rank, world))
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.qkv_bias
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = Linear(hidden, qkv_heads * self.head_dim, bias=bias)
        self.o_proj = row_linear(self.num_heads * self.head_dim, hidden, config.o_bias, tp)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        # [T, heads + 2 * kv_heads, head_dim]: q heads, then k heads, then v heads.
        qkv = self.qkv_proj.forward(x).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split_with_sizes([heads + kv_heads, kv_heads], dim=1)
        if self.qk_norm:
            q, k = qk.split_with_sizes([heads, kv_heads], dim=1)
            qk = torch.cat([self.q_norm.forward(q), self.k_norm.forward(k)], dim=1)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # two selects: cheaper than unbind
        # q and k heads rotate together, and the keys go to the cache in the same pass.
        qk = rotate_and_store_kv(qk, v, cos, sin, key_cache, value_cache, meta.slot_mapping)
        out = paged_attention(
            qk[:, :heads],
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.query_start_loc_host,
            meta.seq_lens_host,
            self.scale,
            self.sliding_window,
        )
        return self.o_proj.forward(out.view(num_tokens, heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(
        self, config: DecoderConfig, tp: TPGroup | None = None, reduce_output: bool = True
    ) -> None:
        """`tp`: the group the intermediate features are split over; `reduce_output`
        False leaves the sum over its ranks to the caller (a MoE block sums once)."""
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported")
        hidden, bias = config.hidden_size, config.mlp_bias
        world = tp.world_size if tp is not None else 1
        inter = split_evenly(config.intermediate_size, world, "intermediate_size")
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = row_linear(inter, hidden, bias, tp if reduce_output else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it) for the previous
        layer's pair, or for (embeddings, None) in the first layer.

        Each residual add is deferred into the next norm (`forward_with_residual`), so an
        add and a norm are one op where the C++ kernels run.
        """
        if residual is None:
            residual, x = x, self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.self_attn.forward(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp.forward(x), residual

    def decode_tensors(self) -> dict[str, torch.Tensor | None] | None:
        """This layer's tensors by `corestream_kernels.decoder_layers.LAYER_TENSORS` name, for
        the C++
        decode path; None if the layer is not a plain Llama-family one (e.g. its MLP is a
        mixture of experts, or a fused projection of mixed block types)."""
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return None
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(isinstance(p, MixedQuantizedLinear) for p in projections):
            # NOTE: the op takes one weight per projection; a Q4_K_M file's q/k/v of two
            # types would need its parts side by side there too.
            return None
        return {
            "input_norm": self.input_layernorm.weight,
            **linear_tensors("qkv", attn.qkv_proj),
            "q_norm": attn.q_norm.weight if attn.qk_norm else None,
            "k_norm": attn.k_norm.weight if attn.qk_norm else None,
            **linear_tensors("o", attn.o_proj),
            "post_norm": self.post_attention_layernorm.weight,
            **linear_tensors("gate_up", mlp.gate_up_proj),
            **linear_tensors("down", mlp.down_proj),
        }


def linear_tensors(name: str, module: nn.Module) -> dict[str, torch.Tensor | None]:
    """A projection's `{name}_weight`, `{name}_panels` and `{name}_bias` for the C++
    decode op: a `QuantizedLinear`'s blocks and their `quant_format` in the first two."""
    if isinstance(module, QuantizedLinear):
        weight, panels = module.blocks, quant_format(module.weight)
    else:
        weight, panels = module.weight, module.panels
    return {f"{name}_weight": weight, f"{name}_panels": panels, f"{name}_bias": module.bias}


@dataclasses.dataclass(slots=True)
class _HeadOutputs:
    outputs: list[torch.Tensor] | None = None


def _embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding, left uninitialized when built on the meta device (as the loader
    builds every model before it fills the weights from the checkpoint): torch's random
    init there runs its Python reference ops, whose first use imports dynamo, over a
    second of every engine's and worker's start."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num_embeddings, embedding_dim,
                            _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


class LlamaModel(nn.Module):
    def __init__(self, config: DecoderConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            _embedding(config.vocab_size, config.hidden_size) if tp is None
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._windows = [config.layer_window(i) or 0 for i in range(config.num_hidden_layers)]
        # [hidden states, logits, argmax] of the last decode step whose head ran in the
        # C++ op. Kept in a holder: nn.Module's __setattr__ would cost tens of
        # microseconds a step on the cold caches after the op.
        self._head = _HeadOutputs()
        # [] (never the C++ decode op) when sharded: it cannot all-reduce between layers.
        self._flat_weights: list[torch.Tensor] | None = None if tp is None else []
        # The C++ decode op bound to this model, for the backend and head it was bound
        # for (tests switch backends; relatives may call without a head).
        self._decode: tuple[str, nn.Module | None, DecodeModel | None] | None = None
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        head: nn.Module | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]`. With `head` (the LM head), a decode step
        that runs in the C++ op computes its logits there too: `head_logits` hands
        them over."""
        if (input_ids.shape[0] == len(meta.seq_lens_host)  # one token each
                and (decode := self.decode_op(head)) is not None):
            outputs = decode(input_ids, positions, kv_caches, meta.slot_mapping,
                             meta.block_tables, meta.seq_lens)
            if len(outputs) == 3:
                self._head.outputs = outputs
            return outputs[0]
        cos, sin = self.rotary_emb.cos_sin(positions)
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, cos, sin, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm.forward(x)
        return self.norm.forward_with_residual(x, residual)[0]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The head's logits for `hidden`, if the forward that returned it computed them
        (once: they are dropped as they are handed over)."""
        found, self._head.outputs = self._head.outputs, None
        return found[1] if found is not None and found[0] is hidden else None

    def decode_op(self, head: nn.Module | None) -> DecodeModel | None:
        """The C++ op for a decode-only step, bound once per backend and head: None where
        it does not apply, or where the layers are not all plain Llama-family ones."""
        backend = get_backend()
        bound = self._decode
        if bound is None or bound[0] != backend or bound[1] is not head:
            bound = self._decode = (backend, head, self._bind_decode_model(head))
        return bound[2]

    def forget_decode_op(self) -> None:
        """Its weights were replaced (a live update): bind the C++ decode op anew on its
        next use, to the new tensors."""
        if self._flat_weights:  # [] stays: sharded, or layers the op cannot take
            self._flat_weights = None
        self._decode = None

    def _decode_weights(self) -> list[torch.Tensor]:
        """The C++ decode op's `weights`, or [] where it cannot take the layers: ones not
        plain Llama-family."""
        tensors = [layer.decode_tensors() for layer in self.layers]
        usable = [t for t in tensors if t is not None]
        if len(usable) < len(tensors):
            logger.info("decode steps: per-layer Python path (not all layers are plain "
                        "Llama-family ones, or some fuse quantized parts of mixed types)")
            return []
        if has_quantized_layers(self):
            logger.info("decode steps: one C++ call, its quantized linear layers multiplied "
                        "as quant_linear multiplies them, by the file's blocks")
        return flat_weights(usable)

    def _bind_decode_model(self, head: nn.Module | None) -> DecodeModel | None:
        if self._flat_weights is None:
            # Gathered on first use, once the loader has put the checkpoint's tensors in
            # place (and laid them out), and again after a weight update.
            self._flat_weights = self._decode_weights()
        if not self._flat_weights:
            return None
        attn = self.layers[0].self_attn
        norm = self.norm.weight
        op = cpu_decode_model(norm, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if op is None:
            return None
        table = self.embed_tokens
        embedding = ([table.blocks, quant_format(table.weight)]
                     if isinstance(table, QuantizedEmbedding) else [table.weight])
        # A float head without panels: the caller runs it.
        head_tensors: list[torch.Tensor] = []
        if head is not None and (isinstance(head, QuantizedLinear)
                                 or getattr(head, "panels", None) is not None):
            head_tensors = [ABSENT if t is None else t
                            for t in linear_tensors("head", head).values()]
        return DecodeModel(
            op, embedding, self.rotary_emb.table(norm.device), self._flat_weights,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, self._windows,
            norm, self.norm.eps, head_tensors)


class LlamaForCausalLM(nn.Module):
    packed_projections: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    """Fused module -> the checkpoint modules it concatenates, in output order."""

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        """This family's reading of config.json; relatives override it, not the layers."""
        return DecoderConfig.from_hf(hf_config)

    def __init__(self, config: DecoderConfig, tp_group: TPGroup | None = None) -> None:
        """Sharded over `tp_group`, or else over the process's current TP group, if
        either has more than one rank."""
        super().__init__()
        self.config = config
        self.tp = sharding_group(tp_group if tp_group is not None else current_tp_group())
        self.model = LlamaModel(config, self.tp)
        self.lm_head: Linear = (
            Linear(config.hidden_size, config.vocab_size, bias=False) if self.tp is None
            else VocabParallelLMHead(config.hidden_size, config.vocab_size, self.tp)
        )
        world, rank = (self.tp.world_size, self.tp.rank) if self.tp is not None else (1, 0)
        self.local_kv_heads = len(kv_heads_of_rank(config.num_key_value_heads, rank, world))
        """KV heads in this rank's cache: all of them without tensor parallelism."""

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]` for tokens `[T]` at `positions` `[T]`.

        `kv_caches[i]` is layer i's cache `[2, num_blocks, block_size, kv_heads, head_dim]`.
        """
        # Unsharded, the decode op may run the head too, in the same parallel region.
        head = self.lm_head if self.tp is None else None
        return self.model(input_ids, positions, meta, kv_caches, head)

    def decode_greedy(self, kv_caches: list[torch.Tensor], input_ids: list[int],
                      positions: list[int], slot_mapping: list[int],
                      block_tables: list[Sequence[int]], seq_lens: list[int]
                      ) -> list[int] | None:
        """Each sequence's greedy next token (the argmax of its logits, as the sampler would
        pick it) for a decode step: one token per sequence, at `positions`, written to
        `slot_mapping`, with each sequence's blocks (unpadded) and length. The whole step
        runs in the C++ op with the head, from these lists, with no tensor built in
        Python. None where that op does not apply (then run `forward`)."""
        decode = self.model.decode_op(self.lm_head) if self.tp is None else None
        if decode is None or not decode.has_head:
            return None
        return decode.greedy(kv_caches, input_ids, positions, slot_mapping, block_tables,
                             seq_lens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits `[N, vocab]` for hidden states `[N, hidden]`; the full
        vocabulary on every rank under tensor parallelism (the head all-gathers)."""
        logits = self.model.head_logits(hidden_states)
        if logits is None:
            logits = self.lm_head(hidden_states)
        return logits.float()
