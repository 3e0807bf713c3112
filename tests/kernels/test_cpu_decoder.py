"""The C++ decode path (`decode_model`: the embedding, every layer and the final norm of a
decode-only step in one call) against the Python model it replaces, on real checkpoints of
each dense family."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from corestream_kernels import backend, cpu_linear
from corestream_kernels.decoder_layers import LAYER_TENSORS, flat_weights

from services.common.sampling import SamplingParams
from services.engine.models.llama import LlamaModel
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from services.engine.worker.model_runner import ModelRunner
from tests.kernels.decoder_driver import GREEDY, DecodeCalls, decode_logits, greedy_decode
from tests.unit.engine.hf_checkpoints import VOCAB, make_checkpoint
from tests.unit.engine.runner_driver import all_logits, make_runner, random_prompts

# Each family switches on a different part of the op: plain Llama; Mistral's sliding
# window (shorter than the contexts below); Qwen2's q/k/v bias and a window in some
# layers only; Qwen3's per-head q/k norms.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 12},
    "qwen2": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    "qwen3": {},
}


# How the loader lays out the linear weights: packed for oneDNN with the panels the C++
# kernel reads where this CPU runs it (or, for bfloat16 oneDNN cannot take, panels
# alone), packed without them, or plain (a torch without oneDNN or the C++ kernels).
LAYOUTS = ("panels", "onednn-packed", "plain")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_model_gives_the_python_model_bits(
    cpu_ops: Any, family: str, dtype: torch.dtype, layout: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if layout == "panels" and not cpu_ops.panel_linear_supported(dtype):
        pytest.skip(f"this build has no panel kernel for {dtype}")
    if layout == "onednn-packed" and dtype == torch.bfloat16 and not cpu_linear.onednn_bf16():
        pytest.skip("oneDNN takes no bfloat16 on this CPU: panels alone serve it")
    make_checkpoint(tmp_path, family, dtype=dtype, **FAMILIES[family])
    if layout == "plain":
        monkeypatch.setattr(cpu_linear, "can_pack", lambda weight: False)
    if layout != "panels":
        monkeypatch.setattr(cpu_linear, "weight_panels", lambda weight, packed: None)
        monkeypatch.setattr(cpu_linear, "own_panels", lambda weight: None)
    runner = make_runner(tmp_path, dtype="auto")
    down = runner.model.model.layers[0].mlp.down_proj
    if layout == "panels":
        assert down.weight.is_mkldnn or cpu_linear.is_panels_only(down.weight)
    else:
        assert down.weight.is_mkldnn == (layout == "onednn-packed")
    assert (down.panels is not None) == (layout == "panels")
    # Contexts of different lengths, past the window, across block boundaries.
    prompts = random_prompts({"a": 3, "b": 17, "c": 30}, VOCAB)
    steps = 6

    python = DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, steps, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    plans_before, _, _, built_before = cpu_ops.stage_plan_counters()[:4]
    head_steps = []
    head_logits = LlamaModel.head_logits

    def counted_head_logits(model: LlamaModel, hidden: torch.Tensor) -> Any:
        found = head_logits(model, hidden)
        head_steps.append(found is not None)
        return found

    monkeypatch.setattr(LlamaModel, "head_logits", counted_head_logits)
    got = decode_logits(runner, prompts, steps, "cpp-")

    assert python.count == 0
    assert fused.count == steps  # every decode step, never the prefill
    # The head runs in the op where it has panels (laid out with them, or a tied head's own).
    head_in_op = runner.model.lm_head.panels is not None
    assert head_in_op == (layout == "panels")
    assert sum(head_steps) == (steps if head_in_op else 0)
    # Three sequences: one StagePlan per step where every linear reads panels.
    planned = layout == "panels" and torch.get_num_threads() > 1
    plans_after, _, _, built_after = cpu_ops.stage_plan_counters()[:4]
    assert plans_after - plans_before == (steps if planned else 0)
    # Built for the first step, run again for the others: the batch size holds, and the
    # block tables grow within the width it was built with.
    assert built_after - built_before == (1 if planned else 0)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_float16_cache_gives_the_python_model_bits(
    cpu_ops: Any, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --kv-cache-dtype float16 under a float32 model: the op rotates keys in float32 and
    # rounds them (and the values) into the cache once, as rotary_store_kv does, and its
    # attention reads them as paged_decode does (Qwen3: keys normed per head first).
    if not cpu_ops.panel_linear_supported(torch.float32):
        pytest.skip("this build has no panel kernel for float32")
    make_checkpoint(tmp_path, family, dtype=torch.float32, **FAMILIES[family])
    runner = make_runner(tmp_path, dtype="auto", kv_cache_dtype="float16")
    assert all(cache.dtype == torch.float16 for cache in runner.kv_caches)
    prompts = random_prompts({"a": 3, "b": 17, "c": 30}, VOCAB)
    python = DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, 6, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    got = decode_logits(runner, prompts, 6, "cpp-")
    assert python.count == 0 and fused.count == 6
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_items_retaken_from_a_late_thread_give_the_same_bits(
    cpu_ops: Any, family: str, dtype: torch.dtype, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, two_threads: None,
) -> None:
    """The second thread takes the first item of every stage and starts it 2 ms late, as if
    preempted: the first computes it again and goes on, and the late thread still writes
    it, the same bits, later."""
    if not cpu_ops.panel_linear_supported(dtype):
        pytest.skip(f"this CPU has no few-row kernel for {dtype}")
    make_checkpoint(tmp_path, family, dtype=dtype, **FAMILIES[family])
    runner = make_runner(tmp_path, dtype="auto")
    torch.set_num_threads(2)  # the runner set the machine's count
    prompts = random_prompts({"a": 3, "b": 17}, VOCAB)
    steps = 4
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, steps, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    plans, stages, retaken, _ = cpu_ops.stage_plan_counters()[:4]
    cpu_ops.set_stage_plan_late_us(2000)
    try:
        got = decode_logits(runner, prompts, steps, "late-")
    finally:
        cpu_ops.set_stage_plan_late_us(0)
    plans_after, stages_after, retaken_after, _ = cpu_ops.stage_plan_counters()[:4]

    assert fused.count == steps
    assert plans_after - plans == steps
    # Each stage's first item, unless the first thread itself was off the CPU for the
    # whole 2 ms (a loaded machine): then the late item is done when it looks.
    assert retaken_after - retaken > (stages_after - stages) // 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: max diff {(g - w).abs().max()}"


@pytest.fixture
def llama_runner(cpu_ops: Any, tmp_path: Path, two_threads: None) -> ModelRunner:
    """A Llama runner whose decode steps the op runs in one region (two threads, panels)."""
    if not cpu_ops.panel_linear_supported(torch.float32):
        pytest.skip("this CPU has no few-row kernel for float32")
    make_checkpoint(tmp_path, "llama")
    runner = make_runner(tmp_path, max_model_len=64)
    torch.set_num_threads(2)  # the runner set the machine's count
    return runner


def test_more_sequences_than_the_panel_rows_keep_a_region_per_op(
    cpu_ops: Any, llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = llama_runner
    prompts = random_prompts({f"s{i}": 2 + i for i in range(9)}, VOCAB)  # 9 > 8 rows
    DecodeCalls(monkeypatch, enabled=False)
    want = decode_logits(runner, prompts, 2, "py-")
    fused = DecodeCalls(monkeypatch, enabled=True)
    plans = cpu_ops.stage_plan_counters()[0]
    got = decode_logits(runner, prompts, 2, "cpp-")
    assert fused.count == 2
    assert cpu_ops.stage_plan_counters()[0] == plans
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_kept_plan_is_rebuilt_for_another_batch_size(
    cpu_ops: Any, llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = llama_runner
    batches = [random_prompts({"a": 3, "b": 9}, VOCAB), random_prompts({"c": 5}, VOCAB),
               random_prompts({"d": 4, "e": 2}, VOCAB)]
    DecodeCalls(monkeypatch, enabled=False)
    want = [decode_logits(runner, prompts, 2, f"py{i}-") for i, prompts in enumerate(batches)]
    fused = DecodeCalls(monkeypatch, enabled=True)
    built = cpu_ops.stage_plan_counters()[3]
    got = [decode_logits(runner, prompts, 2, f"cpp{i}-") for i, prompts in enumerate(batches)]
    assert fused.count == 6
    assert cpu_ops.stage_plan_counters()[3] - built == 3  # sizes 2, 1, 2: one plan kept
    for g_steps, w_steps in zip(got, want, strict=True):
        for g, w in zip(g_steps, w_steps, strict=True):
            assert torch.equal(g, w)


def test_each_step_returns_tensors_of_its_own(cpu_ops: Any, llama_runner: ModelRunner) -> None:
    """A kept plan's buffers are the next step's: what a step returns must not be among
    them. A step refused for its inputs leaves the plan as it was. Outside inference
    mode (the model's parameters require grad) the op runs all the same."""
    runner = llama_runner
    decode = runner.model.model.decode_op(runner.model.lm_head)
    assert decode is not None
    prompt = [5, 7]

    def step(position: int, block_tables: torch.Tensor | None = None,
             inference: bool = True) -> list[torch.Tensor]:
        r = ScheduledRequest("x", [prompt[position]], position, [0], True, GREEDY, prompt, [])
        batch = runner._prepare([r])
        meta = batch.meta
        tables = meta.block_tables if block_tables is None else block_tables
        with torch.inference_mode(inference):
            return decode(batch.input_ids, batch.positions, runner.kv_caches,
                          meta.slot_mapping, tables, meta.seq_lens)

    built = cpu_ops.stage_plan_counters()[3]
    first = step(0)
    kept = [t.clone() for t in first]
    second = step(1)
    assert len(first) == 3  # hidden states, logits, argmax: the head has panels
    assert not torch.equal(first[1], second[1])
    for before, now in zip(kept, first, strict=True):
        assert torch.equal(before, now)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 2 exceeds its block table"):
        step(1, block_tables=torch.zeros(1, 0, dtype=torch.int32))
    assert runner.model.model.embed_tokens.weight.requires_grad
    again = step(1, inference=False)
    for a, b in zip(again, second, strict=True):
        assert torch.equal(a, b)
    assert cpu_ops.stage_plan_counters()[3] - built == 1


@pytest.mark.parametrize("nan", [False, True], ids=["ties", "nan"])
def test_greedy_steps_take_the_ops_argmax_as_torch_picks_it(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None,
    nan: bool,
) -> None:
    """A greedy decode step takes its tokens from the op's own argmax, not the sampler's
    (the whole step from the scheduler's lists, `decode_greedy`): on tied maxima it must
    pick the first, as torch.argmax does, and a NaN over any number, the first NaN."""
    if not cpu_ops.panel_linear_supported(torch.float32):
        pytest.skip("this CPU has no few-row kernel for float32")
    model = make_checkpoint(tmp_path, "llama")
    with torch.no_grad():  # rows 3 and 5 tie for the largest logit, or for the smallest
        head = model.lm_head.weight
        head.zero_()
        head[3] = head[5] = 1.0
        if nan:
            head[9, 0] = head[11, 0] = float("nan")
    model.save_pretrained(tmp_path)
    runner = make_runner(tmp_path, max_model_len=64)
    torch.set_num_threads(2)
    from_op = []
    decode_greedy = runner._decode_greedy
    assert decode_greedy is not None

    def counted(*args: Any) -> list[int] | None:
        found = decode_greedy(*args)
        from_op.append(found is not None)
        return found

    monkeypatch.setattr(runner, "_decode_greedy", counted)
    prompt = random_prompts({"a": 6}, VOCAB)["a"]
    known = list(prompt)
    blocks = list(range(16))
    for step in range(4):
        start = 0 if step == 0 else len(known) - 1
        request = ScheduledRequest("a", known[start:], start, blocks, True, GREEDY, prompt,
                                   known[len(prompt):])
        with torch.inference_mode():
            reference = all_logits(runner, [request])[-1]  # the same step, in Python
        token = runner.execute(SchedulerOutput([request])).sampled["a"]
        assert token == reference.argmax().item(), f"step {step}"
        assert token in ((9,) if nan else (0, 3))
        known.append(token)
    assert from_op == [True, True, True]  # each decode step; the prefill is the sampler's


def test_the_bound_op_follows_the_backend(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op is bound to the model on its first decode step; switching the backend to
    torch afterwards still takes the Python layers, and switching back the op again."""
    make_checkpoint(tmp_path, "llama")
    runner = make_runner(tmp_path, max_model_len=64)
    prompts = random_prompts({"a": 5}, VOCAB)
    calls = DecodeCalls(monkeypatch, enabled=True)
    fused = decode_logits(runner, prompts, 2, "cpp-")
    assert calls.count == 2
    previous = backend.get_backend()
    backend.set_backend("torch")
    try:
        python = decode_logits(runner, prompts, 2, "py-")
    finally:
        backend.set_backend(previous)
    assert calls.count == 2
    again = decode_logits(runner, prompts, 2, "again-")
    assert calls.count == 4
    for f, p, a in zip(fused, python, again, strict=True):
        torch.testing.assert_close(p, f, rtol=1e-4, atol=1e-4)
        assert torch.equal(a, f)


def test_mixture_of_experts_layers_keep_the_python_path(
    cpu_ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_checkpoint(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    runner = make_runner(tmp_path)
    assert all(layer.decode_tensors() is None for layer in runner.model.model.layers)
    calls = DecodeCalls(monkeypatch, enabled=True)
    decode_logits(runner, random_prompts({"a": 5}, VOCAB), 2, "moe-")
    assert calls.count == 0


def test_a_wrong_weight_count_is_refused_with_the_expected_one(cpu_ops: Any) -> None:
    hidden = torch.zeros(1, 8)
    one_layer = flat_weights([{"input_norm": torch.ones(8)}])
    assert len(one_layer) == len(LAYER_TENSORS)
    cache = torch.zeros(2, 1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="16 weights per layer for 2 layers, got 16"):
        cpu_ops.decode_layers(
            hidden, one_layer, [cache, cache], torch.ones(1, 8), torch.zeros(1, 8),
            torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, 1, 8, 1.0, [0, 0], 1e-6,
        )


def test_decode_model_refuses_positions_that_do_not_match_the_tokens(cpu_ops: Any) -> None:
    cache = torch.zeros(2, 1, 4, 1, 8)
    with pytest.raises(RuntimeError, match=r"input_ids and positions must be \[B\]"):
        cpu_ops.decode_model(
            torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            [torch.zeros(4, 8)], torch.zeros(2, 16, 8),
            flat_weights([{"input_norm": torch.ones(8)}]), [cache],
            torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), 1, 1, 8, 1.0, [0], torch.ones(8), 1e-6, [],
        )


# Three sequences: one region's plan; ten: more rows than the panels take, a region per op.
@pytest.mark.parametrize("lengths", [{"a": 3, "b": 14, "c": 30},
                                     {f"s{i}": 2 + 3 * i for i in range(10)}],
                         ids=["planned", "unplanned"])
def test_greedy_steps_from_lists_give_the_general_paths_tokens(
    llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, lengths: dict[str, int],
) -> None:
    """Greedy decode steps go from the scheduler's lists straight to the op's argmax
    (`decode_greedy`), across block boundaries, with sequences of different lengths, and
    give the tokens that the batch tensors, the logits and the sampler give."""
    runner = llama_runner
    prompts = random_prompts(lengths, VOCAB)  # blocks of 16
    calls = DecodeCalls(monkeypatch, enabled=True)
    fast = greedy_decode(runner, prompts, 8, "fast-")
    assert calls.count == 8  # every decode step; the prefill is the sampler's
    decode_greedy = runner._decode_greedy
    monkeypatch.setattr(runner, "_decode_greedy", None)
    general = greedy_decode(runner, prompts, 8, "general-")
    assert calls.count == 16  # the general path's forward ran the op
    assert fast == general
    monkeypatch.setattr(runner, "_decode_greedy", decode_greedy)
    # Rows that need the sampler or a logprob take the general path.
    logprobs = SamplingParams(temperature=0.0, logprobs=1)
    prompt = next(iter(prompts.values()))
    request = ScheduledRequest("lp", [prompt[-1]], 2, [60], True, logprobs, prompt, [])
    assert runner._greedy_decode([request]) is None


def test_a_greedy_step_from_lists_refuses_blocks_outside_the_cache(
    llama_runner: ModelRunner,
) -> None:
    runner = llama_runner
    decode = runner.model.model.decode_op(runner.model.lm_head)
    assert decode is not None and decode.has_head
    with pytest.raises(RuntimeError, match=f"block {runner.num_blocks} outside the cache's "
                                           f"{runner.num_blocks} blocks"):
        decode.greedy(runner.kv_caches, [5], [0], [0], [[runner.num_blocks]], [1])
    with pytest.raises(RuntimeError, match="one token, position, slot, block table and length"):
        decode.greedy(runner.kv_caches, [5, 6], [0], [0], [[0]], [1])
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 40 exceeds its block table"):
        decode.greedy(runner.kv_caches, [5], [39], [0], [[0]], [40])
    assert decode.greedy(runner.kv_caches, [5], [0], [0], [[0]], [1])  # still usable
