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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_extension import cpu_ops
from kernels.cpu_paged_attention import decode_shape_supported

LAYER_TENSORS = (
    "input_norm", "qkv_weight", "qkv_panels", "qkv_bias", "q_norm", "k_norm", "o_weight",
    "o_panels", "o_bias", "post_norm", "gate_up_weight", "gate_up_panels", "gate_up_bias",
    "down_weight", "down_panels", "down_bias",
)
"""The tensors each layer hands over, in this order (the C++ op's `Slot`); a bias, norm
or panels (`kernels.cpu_linear.weight_panels`) the layer lacks goes as `ABSENT`."""

ABSENT = torch.empty(0)

# decode_model(input_ids, positions, embedding, rotary_table, weights, kv_caches,
#              slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads, head_dim,
#              scale, windows, final_norm, eps, head) -> [final hidden states] or
#              [final hidden states, logits] where head = [weight, panels, bias]
DecodeModelFn = Callable[..., list[torch.Tensor]]


def cpu_decode_model(
    embedding: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> DecodeModelFn | None:
    """The C++ `decode_model` if it applies to a model with this embedding table and
    head layout (CPU, backend not "torch") and builds; else None.

    It embeds the step's tokens (one per sequence), gathers their rotation rows, runs
    `decode_layers` and the final norm, and returns the final hidden states `[B, hidden]`,
    and with a head the logits `[B, vocab]` (in the model's dtype) after them.
    """
    if not decode_shape_supported(embedding.dtype, num_heads, num_kv_heads, head_dim):
        return None
    ops = cpu_ops(embedding)
    return None if ops is None else ops.decode_model


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """`decode_model` with the arguments that stay the same from step to step bound once:
    a single-stream step runs right after the weights have streamed through the caches,
    where each Python attribute read and check on the way to the op costs microseconds."""

    op: DecodeModelFn
    embedding: torch.Tensor
    rotary_table: torch.Tensor
    weights: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    windows: list[int]
    final_norm: torch.Tensor
    eps: float
    head: list[torch.Tensor]
    """[weight, panels, bias] of the LM head, or [] to leave it to the caller."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
        """[final hidden states], or [final hidden states, logits] with a head."""
        return self.op(input_ids, positions, self.embedding, self.rotary_table, self.weights,
                       kv_caches, slot_mapping, block_tables, seq_lens, self.num_heads,
                       self.num_kv_heads, self.head_dim, self.scale, self.windows,
                       self.final_norm, self.eps, self.head)


def flat_weights(layers: Sequence[dict[str, torch.Tensor | None]]) -> list[torch.Tensor]:
    """The `weights` argument: each layer's `LAYER_TENSORS` in order, ABSENT for None."""
    flat = []
    for tensors in layers:
        for name in LAYER_TENSORS:
            tensor = tensors.get(name)
            flat.append(ABSENT if tensor is None else tensor)
    return flat
