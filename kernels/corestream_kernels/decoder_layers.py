"""A decode-only step's model as one C++ call on CPU (`csrc/decoder_cpu.cpp`).

A Llama-family layer in a decode step is four small matmuls and five small ops; run from
Python, the module calls and op dispatch between them cost about as much as the ops of a
single-stream step. The C++ op runs the same ops in the same order (the Python layers in
`services.engine.models.llama` are its reference, and give the same bits), and the model
calls it only where it applies: CPU tensors of a dtype the extension supports, one token
per sequence, plain Llama-family layers (not mixture-of-experts ones). The embedding, the
rotation rows, the final norm and the LM head (where it has panels) go into the same call
(`decode_model`): after the weights have streamed through the caches, each Python op
between them costs tens of microseconds.
With a few sequences, where every linear reads its panels, the call is one parallel region
in which the threads take the ops' items as they come (`csrc/work_items.h`), so that a
thread preempted by another process does not hold the others at forty barriers a step.
The model binds its weights to the op once (`DecodeModel`), which keeps that region's plan
and buffers from one step to the next while the batch size holds.

A GGUF model's layers that keep the file's blocks (`QuantizedWeight`) go into the same call:
a projection's blocks take its weight's place and `quant_format` its panels', and the op
multiplies them with the GEMV that `corestream_kernels.quant.quant_linear` runs at few rows
(`csrc/quant_projection.h`); a quantized embedding table goes as [blocks, format].

The op without binding, for tests: decode_model(input_ids, positions, embedding,
rotary_table, weights, kv_caches, slot_mapping, block_tables, seq_lens, num_heads,
num_kv_heads, head_dim, scale, windows, final_norm, eps, head) -> [final hidden states]
or [final hidden states, logits, argmax], where embedding = [table] or [blocks, format]
and head = [weight, panels, bias] or [].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from corestream_kernels.cpu_extension import cpu_ops, python_module
from corestream_kernels.cpu_paged_attention import decode_shape_supported
from corestream_kernels.quant import QuantizedWeight

LAYER_TENSORS = (
    "input_norm", "qkv_weight", "qkv_panels", "qkv_bias", "q_norm", "k_norm", "o_weight",
    "o_panels", "o_bias", "post_norm", "gate_up_weight", "gate_up_panels", "gate_up_bias",
    "down_weight", "down_panels", "down_bias",
)
"""The tensors each layer hands over, in this order (the C++ op's `Slot`); a bias, norm
or panels (`corestream_kernels.cpu_linear.weight_panels`) the layer lacks goes as `ABSENT`. A
quantized projection hands over its blocks as its weight and `quant_format` as its
panels."""

ABSENT = torch.empty(0)


def quant_format(weight: QuantizedWeight) -> torch.Tensor:
    """What the op reads beside a quantized weight's blocks: int64 [GGML type,
    in_features, grouped]."""
    return torch.tensor([int(weight.ggml_type), weight.in_features, int(weight.grouped)])


def cpu_decode_model(
    like: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[..., Any] | None:
    """The C++ `DecodeModel` class (the extension module's) if it applies to a model
    whose hidden states are tensors `like` this one (dtype and device) with this head
    layout (CPU, backend not "torch") and builds; else None. `decode_model`'s arguments
    but the step's construct it; its `forward` takes the step's.

    A step embeds its tokens (one per sequence), gathers their rotation rows, runs
    `decode_layers` and the final norm, and returns the final hidden states `[B, hidden]`,
    and with a head the logits `[B, vocab]` (in the model's dtype) and each row's argmax
    `[B]` (int64) after them.
    """
    if not decode_shape_supported(like.dtype, num_heads, num_kv_heads, head_dim):
        return None
    if cpu_ops(like) is None:
        return None
    return python_module().DecodeModel


class DecodeModel:
    """The C++ `DecodeModel` of one model: bound to its weights once, and to the KV caches
    it is stepped with, anew whenever the caller hands over another list of them.

    Bound, the op keeps the plan of its last batch size and takes only the step's five
    tensors per call: a single-stream step runs right after the weights have streamed
    through the caches, where each Python attribute read and each tensor the dispatcher
    converts costs microseconds."""

    __slots__ = ("_make", "_args", "_kv_caches", "_bound")

    def __init__(self, make: Callable[..., Any], embedding: list[torch.Tensor],
                 rotary_table: torch.Tensor, weights: list[torch.Tensor], num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, windows: list[int],
                 final_norm: torch.Tensor, eps: float, head: list[torch.Tensor]) -> None:
        """`embedding`: [table], or a quantized table's [blocks, `quant_format`]. `head`:
        [weight, panels, bias] of the LM head (a quantized one's panels its format), or
        [] to leave it to the caller."""
        self._make = make
        self._args = (embedding, rotary_table, weights, num_heads, num_kv_heads, head_dim,
                      scale, windows, final_norm, eps, head)
        self._kv_caches: list[torch.Tensor] | None = None
        self._bound: Any = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
        """[final hidden states], or [final hidden states, logits, argmax] with a head."""
        return self._bound_to(kv_caches).forward(input_ids, positions, slot_mapping,
                                                 block_tables, seq_lens)

    @property
    def has_head(self) -> bool:
        return bool(self._args[-1])

    def greedy(self, kv_caches: list[torch.Tensor], input_ids: list[int],
               positions: list[int], slot_mapping: list[int],
               block_tables: list[Sequence[int]], seq_lens: list[int]) -> list[int]:
        """Each sequence's greedy next token (the argmax of its logits; needs the head),
        for a step given as plain lists: one token, position, cache slot, block table
        (unpadded) and length per sequence."""
        return self._bound_to(kv_caches).greedy(input_ids, positions, slot_mapping,
                                                block_tables, seq_lens)

    def _bound_to(self, kv_caches: list[torch.Tensor]) -> Any:
        if kv_caches is not self._kv_caches:
            embedding, rotary_table, weights, *rest = self._args
            self._bound = self._make(embedding, rotary_table, weights, kv_caches, *rest)
            self._kv_caches = kv_caches
        return self._bound


def flat_weights(layers: Sequence[dict[str, torch.Tensor | None]]) -> list[torch.Tensor]:
    """The `weights` argument: each layer's `LAYER_TENSORS` in order, ABSENT for None."""
    flat = []
    for tensors in layers:
        for name in LAYER_TENSORS:
            tensor = tensors.get(name)
            flat.append(ABSENT if tensor is None else tensor)
    return flat
