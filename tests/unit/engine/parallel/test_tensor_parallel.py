"""Tensor parallelism over real ranks: gloo on 127.0.0.1, one process per rank.

Layer tests give each rank its shard of one layer's full weights, cut by the loader's
own rules (`ShardPlan`), and compare its output with the unsharded layer's, computed
in the parent. Model tests load tiny random checkpoints through the real loader and
ModelRunner in every rank and compare the logits of a mixed batch and 32 greedy tokens
with those of a single-process runner: every rank must see them all, since the lm_head
all-gathers. Each spawned test runs all its cases in one set of ranks, since starting
a process that imports torch costs seconds on this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.linear import Linear
from services.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from services.engine.models.loader import load_model, pack_projections
from services.engine.models.moe import SparseMoeBlock
from services.engine.models.rotary_embedding import RotaryEmbedding
from services.engine.models.tp_layers import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    kv_heads_of_rank,
)
from services.engine.models.tp_sharding import ShardPlan
from services.engine.parallel.dp_group import init_dp_group, leave_dp_group
from services.engine.parallel.tp_group import current_tp_group, init_tp_group, leave_tp_group
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.integration.cluster import free_port
from tests.unit.engine.runner_driver import GREEDY, all_logits, generate, random_prompts

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128


def run_ranks(world: int, worker: Callable[..., None], *args: Any) -> None:
    """Run `worker(rank, world, port, *args)` in `world` fresh processes; a rank's
    exception fails the test with that rank's traceback. No rank outlives the call,
    also when it fails or times out."""
    context = mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world,
                                 join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def join(rank: int, world: int, port: int) -> None:
    # Ranks share two cores: one thread each, or they fight over both.
    torch.set_num_threads(1)
    init_tp_group(rank, world, "127.0.0.1", port, timeout_s=60)


# --- layers ------------------------------------------------------------------------------

VOCAB = 255  # divisible by neither 2 nor 4
TOKENS = 11


def layer_config(world: int) -> DecoderConfig:
    """Eight query heads over fewer KV heads than ranks; biases on every projection,
    so that a row-parallel bias added more than once would show; q/k norms."""
    return DecoderConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=world // 2, head_dim=8,
        max_position_embeddings=MAX_MODEL_LEN, qkv_bias=True, o_bias=True, qk_norm=True,
        mlp_bias=True,
    )


def random_weights(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * 0.3
            for name, p in module.state_dict().items()}


def unpacked(state: dict[str, torch.Tensor], config: DecoderConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's names for a fused module's tensors: qkv_proj split back into
    q_proj, k_proj and v_proj, gate_up_proj into gate_proj and up_proj."""
    q, kv = (config.num_attention_heads * config.head_dim,
             config.num_key_value_heads * config.head_dim)
    sizes = {"qkv_proj": {"q_proj": q, "k_proj": kv, "v_proj": kv},
             "gate_up_proj": {"gate_proj": config.intermediate_size,
                              "up_proj": config.intermediate_size}}
    out = {}
    for name, tensor in state.items():
        fused = next((f for f in sizes if f"{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        parts = tensor.split(list(sizes[fused].values()))
        for part, piece in zip(sizes[fused], parts, strict=True):
            out[name.replace(fused, part)] = piece
    return out


def shard_into(module: torch.nn.Module, checkpoint: dict[str, torch.Tensor],
               plan: ShardPlan, prefix: str) -> None:
    """Load this rank's shard of the checkpoint tensors named `prefix` + the module's
    names (the sharding rules go by the full names) into `module`, as the loader does."""
    state = {name: plan.read(name, t, tuple(t.shape)) for name, t in checkpoint.items()
             if name.startswith(prefix)}
    pack_projections(state, LlamaForCausalLM.packed_projections)
    module.load_state_dict({n.removeprefix(prefix): t for n, t in state.items()}, strict=True)


def prefill_meta(num_tokens: int) -> AttentionMetadata:
    """One sequence of `num_tokens` prompt tokens in blocks 0, 1, ..."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens_host=[num_tokens],
        query_start_loc_host=[0, num_tokens],
    )


def run_attention(attn: LlamaAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, KV cache) of a prefill of x `[T, hidden]` into an empty cache."""
    cache = torch.zeros(2, -(-x.shape[0] // BLOCK_SIZE), BLOCK_SIZE, attn.num_kv_heads,
                        attn.head_dim)
    rotary = RotaryEmbedding(attn.head_dim, MAX_MODEL_LEN, 10000.0, {})
    cos, sin = rotary.cos_sin(torch.arange(x.shape[0]))
    return attn(x, cos, sin, cache, prefill_meta(x.shape[0])), cache


def layer_inputs(config: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(TOKENS, config.hidden_size, generator=gen)
    # Every id of the first and the last shard, padding included on the last rank.
    ids = torch.tensor([0, 1, VOCAB - 1, 64, 127, 128, 191, 192, 63, VOCAB - 2, 100])
    return hidden, ids


def reference_layers(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(checkpoint tensors by checkpoint name, the unsharded layers' outputs)."""
    config = layer_config(world)
    hidden, ids = layer_inputs(config)
    attn, mlp = LlamaAttention(config, 0), LlamaMLP(config)
    attn_weights, mlp_weights = random_weights(attn, 1), random_weights(mlp, 2)
    attn.load_state_dict(attn_weights)
    mlp.load_state_dict(mlp_weights)
    table = torch.randn(VOCAB, config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights = {
        **{f"layers.0.self_attn.{n}": t for n, t in attn_weights.items()},
        **{f"layers.0.mlp.{n}": t for n, t in mlp_weights.items()},
        "embed_tokens.weight": table, "lm_head.weight": table,
    }
    with torch.inference_mode():
        attn_out, cache = run_attention(attn, hidden)
        want = {
            "attn": attn_out, "cache": cache,
            "gate_up": mlp.gate_up_proj(hidden), "mlp": mlp(hidden),
            "embed": F.embedding(ids, table), "logits": F.linear(hidden, table),
        }
    return unpacked(weights, config), want


def layer_worker(rank: int, world: int, port: int, weights: dict[str, torch.Tensor],
                 want: dict[str, torch.Tensor]) -> None:
    join(rank, world, port)
    group = current_tp_group()
    assert group is not None
    config = layer_config(world)
    plan = ShardPlan(config, rank, world)
    hidden, ids = layer_inputs(config)
    attn, mlp = LlamaAttention(config, 0, group), LlamaMLP(config, group)
    shard_into(attn, weights, plan, "layers.0.self_attn.")
    shard_into(mlp, weights, plan, "layers.0.mlp.")
    embed = VocabParallelEmbedding(VOCAB, config.hidden_size, group)
    head = VocabParallelLMHead(config.hidden_size, VOCAB, group)
    shard_into(embed, weights, plan, "embed_tokens.")
    shard_into(head, weights, plan, "lm_head.")
    close = {"atol": 1e-5, "rtol": 1e-5}
    with torch.inference_mode():
        attn_out, cache = run_attention(attn, hidden)
        torch.testing.assert_close(attn_out, want["attn"], **close)
        # This rank's cache holds its KV heads, and only those.
        heads = kv_heads_of_rank(config.num_key_value_heads, rank, world)
        torch.testing.assert_close(cache, want["cache"][:, :, :, heads.start:heads.stop])
        # Column-parallel: this rank's gate rows, then its up rows.
        inter = config.intermediate_size
        rows = torch.arange(rank * inter // world, (rank + 1) * inter // world)
        torch.testing.assert_close(
            mlp.gate_up_proj(hidden), want["gate_up"][:, torch.cat([rows, inter + rows])],
            **close,
        )
        # Row-parallel down_proj: partial products summed, its bias added once.
        torch.testing.assert_close(mlp(hidden), want["mlp"], **close)
        torch.testing.assert_close(embed(ids), want["embed"], **close)
        logits = head(hidden)
        assert logits.shape == (TOKENS, VOCAB) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, want["logits"], **close)
    leave_tp_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layers_equal_the_unsharded_ones(world: int) -> None:
    weights, want = reference_layers(world)
    run_ranks(world, layer_worker, weights, want)


# --- whole models ------------------------------------------------------------------------

# name -> (family, config overrides). Every checkpoint has 4 query heads and 2 layers.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # One KV head for two ranks, and a vocabulary that does not split evenly.
    "llama-1-kv-head-vocab-255": ("llama", {"num_key_value_heads": 1, "vocab_size": 255}),
    "mistral-window-8": ("mistral", {"sliding_window": 8}),
    # Tied embeddings share the lm_head's (padded) vocabulary shard.
    "qwen2-bias-tied-vocab-251": ("qwen2", {"tie_word_embeddings": True, "vocab_size": 251}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
    # A shared expert, a sparse layer (0) and a dense one (1).
    "qwen2-moe": ("qwen2_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "intermediate_size": 96, "mlp_only_layers": [1],
    }),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "intermediate_size": 32}),
    # On four ranks: two KV heads, each held by the two ranks whose query heads use it.
    "llama-2-kv-heads-vocab-255": ("llama", {"vocab_size": 255}),
}
# The models each world size runs (four ranks on two cores: one model only).
MODELS_ON = {2: tuple(MODELS)[:-1], 4: tuple(MODELS)[-1:]}

PROMPT_LENGTHS = {"a": 5, "b": 13, "c": 1, "d": 22}
NUM_TOKENS = 32

Outputs = tuple[torch.Tensor, torch.Tensor, dict[str, list[int]]]


def make_runner(folder: Path, kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(RunnerConfig(
        model=str(folder), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
        kv_cache_memory=4 << 20, max_model_len=MAX_MODEL_LEN, num_threads=1,
        kv_cache_dtype=kv_cache_dtype,
    ))


def model_outputs(runner: ModelRunner) -> Outputs:
    """(logits of whole prompts and a chunk, logits of a decode and the chunk's rest,
    greedy tokens of four requests batched with chunked prefills)."""
    vocab = runner.model.config.vocab_size
    ps = random_prompts(PROMPT_LENGTHS, vocab)
    per_request = MAX_MODEL_LEN // BLOCK_SIZE
    blocks = {rid: list(range(i * per_request, (i + 1) * per_request))
              for i, rid in enumerate(ps)}
    split = 9
    step1 = [ScheduledRequest(rid, p[:split] if rid == "d" else p, 0, blocks[rid], True,
                              GREEDY, p, []) for rid, p in ps.items()]
    step2 = [
        ScheduledRequest("a", [vocab - 1], len(ps["a"]), blocks["a"], True, GREEDY, ps["a"], []),
        ScheduledRequest("d", ps["d"][split:], split, blocks["d"], True, GREEDY, ps["d"], []),
    ]
    logits1, logits2 = all_logits(runner, step1), all_logits(runner, step2)
    tokens = generate(runner, ps, NUM_TOKENS, first_chunk={"d": 10, "b": 4})
    return logits1, logits2, tokens


def model_worker(rank: int, world: int, port: int, cases: dict[str, Path],
                 want: dict[str, Outputs], kv_cache_dtype: str = "auto") -> None:
    join(rank, world, port)
    for name, folder in cases.items():
        runner = make_runner(folder, kv_cache_dtype)
        assert runner.kv_caches[0].dtype == (torch.float16 if kv_cache_dtype == "float16"
                                             else torch.float32), name
        config = runner.model.config
        heads = kv_heads_of_rank(config.num_key_value_heads, rank, world)
        assert runner.model.local_kv_heads == len(heads), name
        assert runner.kv_caches[0].shape[3] == len(heads), name
        # This rank read only its shard of the vocabulary.
        vocab_rows = -(-config.vocab_size // world)
        assert runner.model.model.embed_tokens.weight.shape[0] == vocab_rows, name
        logits1, logits2, tokens = model_outputs(runner)
        # A float16 cache rounds each rank's keys and values, whose float32 sums ran in
        # another order than one process's: now and then one lands a float16 step apart
        # (measured: logits up to 2.5e-4 apart, against 4e-6 with a float32 cache).
        tolerance = 2e-3 if kv_cache_dtype == "float16" else 1e-4
        torch.testing.assert_close(logits1, want[name][0], atol=tolerance, rtol=tolerance,
                                   msg=name)
        torch.testing.assert_close(logits2, want[name][1], atol=tolerance, rtol=tolerance,
                                   msg=name)
        assert tokens == want[name][2], name
        del runner
    leave_tp_group()


def checkpoints(names: tuple[str, ...], root: Path) -> dict[str, Path]:
    # Imported here, not at the top: spawned ranks import this module, and they have
    # no use for transformers.
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    folders = {}
    for name in names:
        family, overrides = MODELS[name]
        folders[name] = root / name
        make_checkpoint(folders[name], family, **overrides)
    return folders


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_models_on_tp_ranks_equal_one_process(world: int, tmp_path: Path) -> None:
    cases = checkpoints(MODELS_ON[world], tmp_path)
    want = {name: model_outputs(make_runner(folder)) for name, folder in cases.items()}
    run_ranks(world, model_worker, cases, want)


@pytest.mark.timeout(120)
def test_tp_ranks_with_a_float16_cache_equal_one_process(tmp_path: Path) -> None:
    """`--kv-cache-dtype float16` under a float32 model: each rank keeps its kv heads'
    shard of the cache in float16, and the outputs are one process's with the same cache."""
    cases = checkpoints(MODELS_ON[2], tmp_path)
    want = {name: model_outputs(make_runner(folder, "float16"))
            for name, folder in cases.items()}
    run_ranks(2, model_worker, cases, want, "float16")


# --- tensor parallelism inside expert-parallel DP ranks ---------------------------------

DP_SPLIT = (5, 3)  # tokens of DP rank 0 and 1


def moe_tokens() -> torch.Tensor:
    return torch.randn(sum(DP_SPLIT), 64, generator=torch.Generator().manual_seed(3))


def first_moe_block(folder: Path) -> SparseMoeBlock:
    model = load_model(folder, torch.float32, torch.device("cpu"), MAX_MODEL_LEN)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    return block


def dp_tp_worker(index: int, world: int, port: int, ports: list[int], folder: Path,
                 want: torch.Tensor) -> None:
    # Processes 0, 1 are DP rank 0 and 2, 3 DP rank 1; each DP rank a TP group of two.
    # The DP group of TP rank t joins the processes that hold the same expert shards.
    dp_rank, tp_rank = divmod(index, 2)
    torch.set_num_threads(1)
    init_tp_group(tp_rank, 2, "127.0.0.1", ports[dp_rank], timeout_s=60)
    init_dp_group(dp_rank, 2, "127.0.0.1", ports[2 + tp_rank], timeout_s=60)
    block = first_moe_block(folder)
    # Half of the experts (DP), half of each one's intermediate features (TP).
    assert block.experts.w13.shape == (2, 2 * 16, 64)
    mine = moe_tokens().split(DP_SPLIT)[dp_rank]
    with torch.inference_mode():
        both_busy = block(mine)
        # DP rank 1 idle: both its TP ranks run the layer on zero tokens.
        one_idle = block(mine if dp_rank == 0 else mine[:0])
    torch.testing.assert_close(both_busy, want.split(DP_SPLIT)[dp_rank], atol=1e-5, rtol=0)
    if dp_rank == 0:
        torch.testing.assert_close(one_idle, want.split(DP_SPLIT)[0], atol=1e-5, rtol=0)
    else:
        assert one_idle.shape == (0, 64)
    leave_dp_group()
    leave_tp_group()


@pytest.mark.timeout(60)
def test_moe_block_with_tp_inside_dp_ranks_equals_one_process(tmp_path: Path) -> None:
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    make_checkpoint(tmp_path, "qwen2_moe", num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    intermediate_size=96, mlp_only_layers=[1])
    block = first_moe_block(tmp_path)
    with torch.inference_mode():
        # Each DP rank's tokens on their own, as a single engine would see its batch.
        want = torch.cat([block(x) for x in moe_tokens().split(DP_SPLIT)])
    run_ranks(4, dp_tp_worker, [free_port() for _ in range(4)], tmp_path, want)


# --- checks without ranks ----------------------------------------------------------------


def fake_group(rank: int, world_size: int) -> Any:
    """Enough of a TPGroup to build (not run) a sharded model."""
    return SimpleNamespace(rank=rank, world_size=world_size)


def tiny_config(**overrides: Any) -> DecoderConfig:
    fields: dict[str, Any] = {
        "vocab_size": 64, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64,
    }
    return DecoderConfig(**{**fields, **overrides})


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ({}, 4, "num_attention_heads 6 is not divisible by tensor_parallel_size 4"),
    ({}, 3, "num_key_value_heads 2 is below tensor_parallel_size 3 and does not divide it"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 90}, 4,
     "intermediate_size 90 is not divisible by tensor_parallel_size 4"),
])
def test_a_model_that_does_not_split_says_why(
    overrides: dict[str, Any], world: int, message: str
) -> None:
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        LlamaForCausalLM(tiny_config(**overrides), tp_group=fake_group(0, world))


def test_kv_heads_split_or_follow_their_query_heads() -> None:
    # 8 KV heads over 4 ranks: two each. 2 KV heads over 4 ranks: ranks 0 and 1 hold
    # head 0 (their query heads 0-1 and 2-3 use it), ranks 2 and 3 head 1.
    assert [list(kv_heads_of_rank(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5],
                                                                   [6, 7]]
    assert [list(kv_heads_of_rank(2, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]


def test_without_a_group_the_model_is_the_unsharded_one() -> None:
    config = tiny_config()
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
        one_rank = LlamaForCausalLM(config, tp_group=fake_group(0, 1))
    for model in (plain, one_rank):
        assert model.tp is None and model.local_kv_heads == 2
        assert type(model.model.embed_tokens) is torch.nn.Embedding
        assert type(model.lm_head) is Linear
        assert type(model.model.layers[0].self_attn.o_proj) is Linear
        assert type(model.model.layers[0].mlp.down_proj) is Linear
        assert model.model._flat_weights is None  # the C++ decode path stays available
