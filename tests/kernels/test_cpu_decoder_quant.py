"""The C++ decode path (`decode_model`) over a GGUF model's quantized layers, against the
Python model it replaces, on a small random Llama quantized to each type the kernels
serve. (The real file, SmolLM2-135M Q4_1, is compared in
tests/unit/engine/models/test_gguf_model.py.)

The model is quantized in process as the loader builds it from a GGUF file: the same
projections fused, the same modules swapped in (`place_quantized`), the tied head over the
table's blocks. Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks come from the quantizers;
the K-quants (256 values a block, hence the model's widths) from random bytes, as in
test_quant.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from corestream_kernels.quant import (
    GROUPED_TYPES,
    GGMLType,
    QuantizedWeight,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q5_0,
    quantize_q5_1,
    quantize_q8_0,
)
from transformers import PreTrainedModel

from services.engine.models.linear import QuantizedEmbedding, QuantizedLinear
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.loader import pack_projections, place_quantized
from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.model_runner import ModelRunner
from tests.kernels.decoder_driver import GREEDY, DecodeCalls, decode_logits, greedy_decode
from tests.kernels.quant_weights import random_k_blocks
from tests.unit.engine.hf_checkpoints import VOCAB, make_checkpoint
from tests.unit.engine.runner_driver import all_logits, make_runner, random_prompts

KINDS = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
         GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
QUANTIZERS = {GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0,
              GGMLType.Q4_1: quantize_q4_1, GGMLType.Q5_0: quantize_q5_0,
              GGMLType.Q5_1: quantize_q5_1}
# Rows of whole K-quant blocks; head_dim 64. Tied, as SmolLM2's.
SHAPES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2, "tie_word_embeddings": True}
STEPS = 4


def quantized(name: str, weight: torch.Tensor, kind: GGMLType) -> QuantizedWeight:
    if kind in QUANTIZERS:
        return QUANTIZERS[kind](weight)
    seed = sum(name.encode())  # each tensor its own bytes
    return random_k_blocks(kind, weight.shape[0], weight.shape[1],
                           torch.Generator().manual_seed(seed))


def quantize_as_gguf(runner: ModelRunner, hf_model: PreTrainedModel, kind: GGMLType,
                     keep_float: Callable[[str], bool] = lambda name: False) -> None:
    """Swap the runner's layers for quantized ones, as `load_model` builds them from a
    GGUF file of `kind`, before its first step; tensors `keep_float` names stay float (a
    fused projection with a float part stays a float `Linear`, as one of mixed types)."""
    model = runner.model
    state: dict[str, torch.Tensor | QuantizedWeight] = {
        name: quantized(name, tensor, kind) if not keep_float(name) else tensor
        for name, tensor in hf_model.state_dict().items()
        if name.endswith("_proj.weight") or name == "model.embed_tokens.weight"
    }
    pack_projections(state, LlamaForCausalLM.packed_projections, torch.float32)
    place_quantized(model, state, getattr(torch, runner.dtype))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    model.lm_head = QuantizedLinear(embedding.weight, None)


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def quantized_runner(folder: Path, kind: GGMLType, dtype: str = "float32",
                     keep_float: Callable[[str], bool] = lambda name: False,
                     max_model_len: int = 128) -> ModelRunner:
    hf_model = make_checkpoint(folder, "llama", **SHAPES)
    runner = make_runner(folder, dtype=dtype, max_model_len=max_model_len)
    torch.set_num_threads(2)  # the runner set the machine's count
    quantize_as_gguf(runner, hf_model, kind, keep_float)
    return runner


def assert_same_steps(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert bool(g.isfinite().all())
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_quantized_layers_give_the_python_model_bits(
    cpu_ops: Any, kind: GGMLType, dtype: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    runner = quantized_runner(tmp_path, kind, dtype)
    # The loader groups the rows of the types the grouped GEMV takes (quant_groups.h);
    # the K-quants keep the file's layout.
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.weight.grouped for m in layers} == {kind in GROUPED_TYPES}
    # Contexts of different lengths, across block boundaries.
    prompts = random_prompts({"a": 3, "b": 17, "c": 30}, VOCAB)
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, STEPS, "py-")
    python_tokens = greedy_decode(runner, prompts, STEPS, "py-greedy-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    plans, _, _, built = cpu_ops.stage_plan_counters()[:4]
    got = decode_logits(runner, prompts, STEPS, "cpp-")
    # Three sequences: one StagePlan per step, the head's logits among its outputs.
    assert fused.count == STEPS
    plans_after, _, _, built_after = cpu_ops.stage_plan_counters()[:4]
    assert (plans_after - plans, built_after - built) == (STEPS, 1)
    assert_same_steps(got, want)
    # Greedy steps take the op's own argmax (`decode_greedy`).
    assert greedy_decode(runner, prompts, STEPS, "cpp-greedy-") == python_tokens
    assert fused.count == 2 * STEPS


# One thread: a fork and join per op (quant_linear's own calls). 33 sequences of Q5_K
# (the file's layout): more rows than quant_linear quantizes the activations of, so it
# multiplies the dequantized weight.
@pytest.mark.parametrize("threads,sequences,kind", [(1, 3, GGMLType.Q4_1),
                                                    (2, 33, GGMLType.Q5_K)],
                         ids=["one-thread", "33-rows"])
def test_quantized_steps_off_the_plan_give_the_python_model_bits(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None,
    threads: int, sequences: int, kind: GGMLType,
) -> None:
    runner = quantized_runner(tmp_path, kind, max_model_len=32)
    assert sequences <= 3 or sequences > cpu_ops.quant_gemv_max_rows()
    torch.set_num_threads(threads)
    prompts = random_prompts({f"s{i}": 2 + i % 5 for i in range(sequences)}, VOCAB)
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, 2, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    plans = cpu_ops.stage_plan_counters()[0]
    got = decode_logits(runner, prompts, 2, "cpp-")
    assert fused.count == 2
    assert cpu_ops.stage_plan_counters()[0] == plans
    assert_same_steps(got, want)


def test_grouped_rows_plan_steps_of_any_batch(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    """Grouped rows take the GEMV at every row count, so 40 sequences still run as one
    plan per step, with the Python model's bits (its layers take the same GEMV)."""
    runner = quantized_runner(tmp_path, GGMLType.Q8_0, max_model_len=32)
    sequences = 40
    assert sequences > cpu_ops.quant_gemv_max_rows()
    prompts = random_prompts({f"s{i}": 2 + i % 5 for i in range(sequences)}, VOCAB)
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, 2, "py-")
    DecodeCalls(monkeypatch, enabled=True)
    plans = cpu_ops.stage_plan_counters()[0]
    got = decode_logits(runner, prompts, 2, "cpp-")
    assert cpu_ops.stage_plan_counters()[0] == plans + 2
    assert_same_steps(got, want)


def test_mixed_float_and_quantized_layers_give_the_python_model_bits(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    """A fused projection whose parts a file stores in two types is a float layer (with
    panels) among the quantized ones; the step still runs as one plan."""
    if not cpu_ops.panel_linear_supported(torch.float32):
        pytest.skip("this build has no panel kernel for float32")
    runner = quantized_runner(tmp_path, GGMLType.Q8_0,
                              keep_float=lambda name: name == "model.layers.1.mlp.up_proj.weight")
    mlp = runner.model.model.layers[1].mlp
    assert not isinstance(mlp.gate_up_proj, QuantizedLinear) and mlp.gate_up_proj.panels is not None
    assert isinstance(mlp.down_proj, QuantizedLinear)
    prompts = random_prompts({"a": 5, "b": 9}, VOCAB)
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, STEPS, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    plans = cpu_ops.stage_plan_counters()[0]
    got = decode_logits(runner, prompts, STEPS, "cpp-")
    assert fused.count == STEPS
    assert cpu_ops.stage_plan_counters()[0] - plans == STEPS
    assert_same_steps(got, want)


def test_quantized_items_retaken_from_a_late_thread_give_the_same_bits(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    """The second thread takes the first item of every stage and starts it late: the
    first computes it again, the activations' quantization and the GEMV items among them,
    and the late thread still writes the same bits."""
    runner = quantized_runner(tmp_path, GGMLType.Q4_0)
    prompts = random_prompts({"a": 3, "b": 17}, VOCAB)
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, 2, "py-")
    DecodeCalls(monkeypatch, enabled=True)
    _, stages, retaken, _ = cpu_ops.stage_plan_counters()[:4]
    cpu_ops.set_stage_plan_late_us(2000)
    try:
        got = decode_logits(runner, prompts, 2, "late-")
    finally:
        cpu_ops.set_stage_plan_late_us(0)
    _, stages_after, retaken_after, _ = cpu_ops.stage_plan_counters()[:4]
    assert retaken_after - retaken > (stages_after - stages) // 2
    assert_same_steps(got, want)


def staggered_logits(runner: ModelRunner, prompts: dict[str, list[int]], schedule: list[int],
                     tag: str) -> list[torch.Tensor]:
    """Logits of a prefill of every prompt, then of one decode step of the first n
    sequences for each n in `schedule` (the others wait)."""
    per_request = runner.model_info.max_model_len // runner.block_size
    blocks = {rid: list(range(i * per_request, (i + 1) * per_request))
              for i, rid in enumerate(prompts)}
    known = {rid: list(p) for rid, p in prompts.items()}
    computed = dict.fromkeys(prompts, 0)
    history = []
    for n in [len(prompts), *schedule]:
        scheduled = [
            ScheduledRequest(f"{tag}{rid}", known[rid][computed[rid]:], computed[rid],
                             blocks[rid][: -(-len(known[rid]) // runner.block_size)], True,
                             GREEDY, prompts[rid], known[rid][len(prompts[rid]):])
            for rid in list(prompts)[:n]]
        logits = all_logits(runner, scheduled)
        history.append(logits)
        ends = torch.tensor([len(r.token_ids) for r in scheduled]).cumsum(0) - 1
        for r, token in zip(scheduled, logits[ends].argmax(-1).tolist(), strict=True):
            rid = r.request_id.removeprefix(tag)
            computed[rid] = len(known[rid])
            known[rid].append(token)
    return history


def test_a_kept_plan_runs_a_batch_a_sixteenth_smaller_padded(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    """A step of 30 sequences runs on the kept plan of 32, two rows of padding: the
    Python model's bits for the 30, and the padding stores no keys or values (its rows'
    slots are still the last two sequences', whose next step would see any write). 29 is
    more padding than a sixteenth: a plan of its own."""
    runner = quantized_runner(tmp_path, GGMLType.Q8_0, max_model_len=32)
    prompts = random_prompts({f"s{i:02d}": 2 + i % 5 for i in range(32)}, VOCAB)
    schedule = [32, 30, 32, 29]
    DecodeCalls(monkeypatch, enabled=False)
    want = staggered_logits(runner, prompts, schedule, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    built = cpu_ops.stage_plan_counters()[3]
    got = staggered_logits(runner, prompts, schedule, "cpp-")
    assert fused.count == len(schedule)
    assert cpu_ops.stage_plan_counters()[3] - built == 2  # for 32, then for 29
    assert_same_steps(got, want)
