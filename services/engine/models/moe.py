"""Sparse mixture-of-experts MLP, and the Llama decoder with it (Mixtral, Qwen2/3-MoE).

A router (`gate`) scores every expert per token; each token goes to its top-k experts
by softmax probability, optionally renormalized over those k, and its output is the
probability-weighted sum of theirs. Qwen2-MoE adds a shared expert that every token
passes through, scaled by a sigmoid gate.

The experts' weights are stacked per layer, `w13` `[E, 2I, H]` (gate and up) and `w2`
`[E, H, I]`, which the loader packs from the checkpoint's per-expert tensors
(`packed_experts`); a GGUF file's quantized experts keep their blocks instead, one
quantized layer per expert and projection (`QuantizedExperts`). Only this rank's
experts are stacked when the experts are split over DP ranks
(`services.engine.parallel.expert_parallel`); routing always sees all experts, since the
router is replicated.

Under tensor parallelism every expert's intermediate features are split over the TP
ranks (w13 holds this rank's gate and up rows, w2 the matching columns), and so are
the shared expert's; the block sums its partial output over the ranks once, after the
experts and the shared expert. Combined with expert parallelism, a rank holds its TP
share of its DP rank's experts: the DP group then joins the ranks of one TP rank (the
same shard of every expert), so the expert dispatch sums over experts and the TP
all-reduce over shards, in either order.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from corestream_kernels.activation import silu_and_mul
from torch import nn

from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.decoder_config import DecoderConfig, MoEConfig
from services.engine.models.linear import Linear
from services.engine.models.llama import LlamaForCausalLM, LlamaMLP
from services.engine.models.tp_layers import all_reduce, split_evenly
from services.engine.parallel.dp_group import DPGroup, current_dp_group
from services.engine.parallel.expert_parallel import ExpertParallel
from services.engine.parallel.tp_group import TPGroup


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, expert ids `[T, k]`) from router logits `[T, E]`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class _ExpertDispatch(nn.Module):
    """Runs each of a layer's local experts (`first`, `first + 1`, ...) on the tokens
    routed to it; subclasses say how one expert's SwiGLU MLP is computed."""

    first: int

    @property
    def num_local(self) -> int:
        raise NotImplementedError

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `local`'s output `[M, H]` for its tokens `x` `[M, H]`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum `[T, H]` of the outputs of this module's experts among each
        token's `ids` `[T, k]`; zero for a token routed to none of them."""
        out = torch.zeros_like(x)
        top_k = ids.shape[1]
        # Sort the T*k (token, choice) slots by expert: each expert's slots become one
        # run of `order`, and the counts, read once, give every run's bounds.
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.first + self.num_local).tolist()
        flat_weights = weights.flatten()
        start = sum(counts[: self.first])
        for local in range(self.num_local):
            count = counts[self.first + local]
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // top_k
            y = self.expert_mlp(local, x[tokens])
            out.index_add_(0, tokens, (y * flat_weights[slots, None]).to(x.dtype))
        return out


class StackedExperts(_ExpertDispatch):
    """The SwiGLU experts `experts` of one layer, as two stacked weight tensors."""

    def __init__(self, experts: range, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.first = experts.start
        self.w13 = nn.Parameter(torch.empty(len(experts), 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(len(experts), hidden_size, intermediate_size))

    @property
    def num_local(self) -> int:
        return self.w13.shape[0]

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, self.w13[local])), self.w2[local])


class QuantizedExperts(_ExpertDispatch):
    """A GGUF file's experts of one layer, each kept as the file's blocks: per expert a
    gate+up projection and a down projection (`QuantizedLinear`, or `MixedQuantizedLinear`
    where gate and up come in types that cannot share one weight)."""

    def __init__(self, first: int, w13: list[nn.Module], w2: list[nn.Module]) -> None:
        super().__init__()
        self.first = first
        self.w13 = nn.ModuleList(w13)
        self.w2 = nn.ModuleList(w2)

    @property
    def num_local(self) -> int:
        return len(self.w13)

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        return self.w2[local].forward(silu_and_mul(self.w13[local].forward(x)))


class SparseMoeBlock(nn.Module):
    def __init__(
        self, config: DecoderConfig, ep: ExpertParallel, tp: TPGroup | None = None
    ) -> None:
        """`tp`: the group each expert's intermediate features are split over."""
        super().__init__()
        moe = config.moe
        assert moe is not None
        hidden = config.hidden_size
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.ep = ep
        self.tp = tp
        self.gate = Linear(hidden, moe.num_experts, bias=False)
        world = tp.world_size if tp is not None else 1
        self.experts: _ExpertDispatch = StackedExperts(
            ep.local_experts(moe.num_experts), hidden,
            split_evenly(moe.intermediate_size, world, "the experts' intermediate_size"),
        )
        self.shared_expert: LlamaMLP | None = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                config, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False
            )
            # Named here: LlamaMLP's own check would blame intermediate_size.
            split_evenly(moe.shared_expert_intermediate_size, world,
                         "shared_expert_intermediate_size")
            # Its partial sum joins the experts' in the block's one all-reduce.
            self.shared_expert = LlamaMLP(shared, tp, reduce_output=False)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ep.dispatch(x, self._run_local_experts)
        if self.shared_expert is not None:
            # Replicated over the DP ranks, so it runs on this rank's tokens only; the
            # gate is replicated over TP ranks too, and scales each partial sum alike.
            gate = torch.sigmoid(self.shared_expert_gate.forward(x))
            out = out + gate * self.shared_expert.forward(x)
        if self.tp is not None:
            out = all_reduce(self.tp, out)
        return out

    def _run_local_experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate.forward(x), self.top_k, self.renormalize)
        return self.experts.forward(x, weights, ids)


class SparseMoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with `SparseMoeBlock` as the MLP of `config.moe.sparse_layers`.

    Built under the process's DP group (`current_dp_group`), if any, it holds only that
    rank's share of the experts (`local_experts`), which is all the loader reads; under
    a TP group, only this TP rank's shard of each of them.
    """

    packed_experts: ClassVar[dict[str, tuple[str, ...]]] = {
        "w13": ("gate_proj", "up_proj"),
        "w2": ("down_proj",),
    }
    """Stacked expert parameter -> the per-expert checkpoint modules it concatenates."""
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    """Checkpoint module name -> ours, where a family names a module differently."""

    def __init__(
        self,
        config: DecoderConfig,
        dp_group: DPGroup | None = None,
        tp_group: TPGroup | None = None,
    ) -> None:
        super().__init__(config, tp_group)
        moe: MoEConfig | None = config.moe
        if moe is None:
            raise ValueError(f"{type(self).__name__} needs a config with moe set")
        self.expert_parallel = ExpertParallel(
            dp_group if dp_group is not None else current_dp_group()
        )
        self.local_experts = self.expert_parallel.local_experts(moe.num_experts)
        for i in moe.sparse_layers:
            self.model.layers[i].mlp = SparseMoeBlock(config, self.expert_parallel, self.tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        with self.expert_parallel.forward_batch(input_ids.shape[0], input_ids.device):
            return super().forward(input_ids, positions, meta, kv_caches)
