"""Our Llama over the paged cache against transformers on the same random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from services.common.tiny_checkpoint import ensure_tiny_checkpoint
from services.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.runner_driver import GREEDY, generate

VOCAB = 256
PROMPT_LENGTHS = {"a": 5, "b": 13, "c": 1, "d": 22}

VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
}


def make_checkpoint(folder: Path, **overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # Wider than the default 0.02 so that attention, not just embeddings, decides.
        initializer_range=0.15,
        **overrides,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def make_runner(folder: Path) -> ModelRunner:
    config = RunnerConfig(
        model=str(folder), device="cpu", block_size=4, kv_cache_memory=4 << 20, max_model_len=128
    )
    return ModelRunner(config)


def prompts(lengths: dict[str, int], vocab: int = VOCAB) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)
    return {rid: torch.randint(3, vocab, (n,), generator=gen).tolist()
            for rid, n in lengths.items()}


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    # eos_token_id=[] and min_new_tokens: never stop early, never mask anything.
    config = GenerationConfig(
        do_sample=False, max_new_tokens=num_tokens, eos_token_id=[], pad_token_id=0
    )
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert out.shape[1] == len(prompt) + num_tokens
    return out[0, len(prompt):].tolist()


def all_logits(runner: ModelRunner, requests: list[ScheduledRequest]) -> torch.Tensor:
    """Logits of every token of the step, not only the sampled ones."""
    with torch.inference_mode():
        batch = runner._prepare(requests)
        hidden = runner.model(batch.input_ids, batch.positions, batch.meta, runner.kv_caches)
        return runner.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LlamaForCausalLM, ModelRunner]:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(folder, **VARIANTS[request.param])
    return hf, make_runner(folder)


def test_logits_match_for_a_mixed_batch(pair: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    hf, runner = pair
    ps = prompts(PROMPT_LENGTHS)
    per_request = 128 // runner.block_size
    # Step 1: whole prompts for a, b, c and the first 9 tokens of d.
    # Step 2: the rest of d (after a cached prefix) alongside one decode of a.
    split = 9
    step1 = [
        ScheduledRequest(rid, p[:split] if rid == "d" else p, 0,
                         list(range(i * per_request, (i + 1) * per_request)),
                         True, GREEDY, p, [])
        for i, (rid, p) in enumerate(ps.items())
    ]
    got1 = all_logits(runner, step1)
    extra = 77
    a, d = step1[0], step1[3]
    step2 = [
        ScheduledRequest("a", [extra], len(ps["a"]), a.block_ids, True, GREEDY, ps["a"], []),
        ScheduledRequest("d", ps["d"][split:], split, d.block_ids, True, GREEDY, ps["d"], []),
    ]
    got2 = all_logits(runner, step2)

    with torch.no_grad():
        want = {rid: hf(torch.tensor([p])).logits[0] for rid, p in ps.items()}
        want_a_next = hf(torch.tensor([ps["a"] + [extra]])).logits[0, -1]
    offsets = [0]
    for r in step1:
        offsets.append(offsets[-1] + len(r.token_ids))
    for i, (rid, p) in enumerate(ps.items()):
        n = split if rid == "d" else len(p)
        torch.testing.assert_close(got1[offsets[i]:offsets[i + 1]], want[rid][:n],
                                   atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got2[0], want_a_next, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got2[1:], want["d"][split:], atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_generate(pair: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    hf, runner = pair
    ps = prompts(PROMPT_LENGTHS)
    ours = generate(runner, ps, num_tokens=32, first_chunk={"d": 10, "b": 4})
    for rid, p in ps.items():
        assert ours[rid] == hf_greedy(hf, p, 32), rid


def test_tiny_checkpoint_matches_transformers(tmp_path: Path) -> None:
    folder = ensure_tiny_checkpoint(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    runner = ModelRunner(RunnerConfig(model=str(folder), device="cpu", kv_cache_memory=8 << 20,
                                      max_model_len=256))
    ps = prompts({"x": 3, "y": 17, "z": 40}, vocab=runner.model_info.vocab_size)
    ours = generate(runner, ps, num_tokens=32, first_chunk={"z": 20})
    for rid, p in ps.items():
        assert ours[rid] == hf_greedy(hf, p, 32), rid


def test_tiny_checkpoint_is_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORESTREAM_CACHE_DIR", str(tmp_path))
    runner = ModelRunner(RunnerConfig(kv_cache_memory=1 << 20, max_model_len=64))
    assert runner.model_info.name == "tiny-llama-v1"
    assert runner.model_info.max_model_len == 64
    assert (runner.device, runner.dtype, runner.block_size) == ("cpu", "float32", 16)
    assert runner.num_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)
    runner.warmup()
    assert runner.execute(SchedulerOutput([])) == {}


def test_too_little_kv_cache_memory_is_a_clear_error(tmp_path: Path) -> None:
    folder = ensure_tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        ModelRunner(RunnerConfig(model=str(folder), kv_cache_memory=1 << 16))


def test_bfloat16_runs(tmp_path: Path) -> None:
    folder = ensure_tiny_checkpoint(tmp_path)
    runner = ModelRunner(RunnerConfig(model=str(folder), dtype="bfloat16",
                                      kv_cache_memory=1 << 20, max_model_len=64))
    assert runner.dtype == "bfloat16" and runner.kv_caches[0].dtype == torch.bfloat16
    out = generate(runner, {"r": [1, 5, 9, 14]}, num_tokens=4)
    assert len(out["r"]) == 4 and all(0 <= t < runner.model_info.vocab_size for t in out["r"])
