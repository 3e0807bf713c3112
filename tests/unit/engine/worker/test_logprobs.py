"""Logprobs of sampled and prompt tokens against transformers on the same weights.

Requests run through a real EngineCore (scheduler + ModelRunner) on a tiny random
Llama written by transformers; the reference is log_softmax of transformers' float32
logits for the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from services.common.sampling import SamplingParams
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.output import PositionLogprobs
from services.engine.worker import model_runner as model_runner_module
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.fakes import run_core, tokens
from tests.unit.engine.hf_checkpoints import VOCAB, hf_logits, make_checkpoint
from tests.unit.engine.runner_driver import make_runner, random_prompts

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, ModelRunner]:
    folder: Path = tmp_path_factory.mktemp("llama")
    model = make_checkpoint(folder, "llama")
    return model, make_runner(folder)


def logprob_request(
    rid: str, prompt: list[int], max_tokens: int = 6, **sampling: object
) -> Request:
    params = SamplingParams(**{"temperature": 0.0, **sampling},  # type: ignore[arg-type]
                            max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, session_id="s")


def generated_logprobs(updates: list[RequestUpdate]) -> list[PositionLogprobs]:
    return [lp for u in updates for lp in u.new_logprobs]


def check_against(ref_row: torch.Tensor, lp: PositionLogprobs, token: int, num_top: int) -> None:
    """ref_row: transformers' log_softmax `[vocab]` at the position that predicts `token`."""
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(ref_row[token].item(), abs=ATOL)
    assert lp.rank == 1 + int((ref_row > ref_row[token]).sum())
    values, ids = ref_row.topk(num_top)
    assert [t for t, _ in lp.top] == ids.tolist()
    assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=ATOL)


def reference(model: PreTrainedModel, tokens_: list[int]) -> torch.Tensor:
    return hf_logits(model, tokens_).log_softmax(dim=-1)


@pytest.mark.timeout(120)
def test_greedy_logprobs_match_transformers(llama: tuple[PreTrainedModel, ModelRunner]) -> None:
    model, runner = llama
    prompts = random_prompts({"a": 13, "b": 5}, VOCAB)
    requests = [logprob_request(rid, p, logprobs=5) for rid, p in prompts.items()]
    out, _ = run_core(runner, requests)
    for rid, prompt in prompts.items():
        generated = tokens(out[rid])
        ref = reference(model, prompt + generated[:-1])
        lps = generated_logprobs(out[rid])
        assert len(lps) == len(generated) == 6
        for i, (token, lp) in enumerate(zip(generated, lps, strict=True)):
            check_against(ref[len(prompt) - 1 + i], lp, token, 5)
            assert lp.rank == 1  # greedy picks the most likely token


@pytest.mark.timeout(120)
def test_logprobs_are_raw_whatever_the_sampling(
    llama: tuple[PreTrainedModel, ModelRunner],
) -> None:
    """Temperature, bias and penalties change what is drawn, not the reported logprobs."""
    model, runner = llama
    prompt = random_prompts({"a": 9}, VOCAB)["a"]
    request = logprob_request("r", prompt, logprobs=0, temperature=1.5, seed=7, top_k=40,
                              repetition_penalty=1.3, logit_bias=((5, 3.0),))
    out, _ = run_core(runner, [request])
    generated = tokens(out["r"])
    ref = reference(model, prompt + generated[:-1])
    lps = generated_logprobs(out["r"])
    for i, (token, lp) in enumerate(zip(generated, lps, strict=True)):
        check_against(ref[len(prompt) - 1 + i], lp, token, 0)
        assert lp.top == ()
    assert any(lp.rank > 1 for lp in lps)  # a hot temperature strays from the argmax


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [2048, 8])
def test_prompt_logprobs_match_transformers(
    llama: tuple[PreTrainedModel, ModelRunner], budget: int
) -> None:
    """budget 8: the 22-token prompt is prefilled in chunks of 8, 8 and 6."""
    model, runner = llama
    prompt = random_prompts({"a": 22}, VOCAB)["a"]
    out, _ = run_core(runner, [logprob_request("r", prompt, 3, prompt_logprobs=4)],
                      max_num_batched_tokens=budget)
    first, *rest = out["r"]
    assert all(not u.prompt_logprobs for u in rest)
    assert len(first.prompt_logprobs) == len(prompt) - 1
    ref = reference(model, prompt)
    for p, lp in enumerate(first.prompt_logprobs):
        check_against(ref[p], lp, prompt[p + 1], 4)
    assert generated_logprobs(out["r"]) == []  # logprobs was not asked


@pytest.mark.timeout(120)
def test_prompt_logprobs_skip_the_prefix_cache(
    llama: tuple[PreTrainedModel, ModelRunner],
) -> None:
    _, runner = llama
    prompt = random_prompts({"a": 20}, VOCAB)["a"]
    out, core = run_core(runner, [logprob_request("warm", prompt, 2)],
                         [logprob_request("plain", prompt, 2)],
                         [logprob_request("asks", prompt, 2, prompt_logprobs=0)])
    assert out["plain"][0].num_cached_tokens == 16  # 4 full blocks of 4
    assert out["asks"][0].num_cached_tokens == 0
    assert len(out["asks"][0].prompt_logprobs) == len(prompt) - 1
    assert tokens(out["asks"]) == tokens(out["plain"])


@pytest.mark.timeout(120)
def test_nothing_is_computed_when_nobody_asks(
    llama: tuple[PreTrainedModel, ModelRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, runner = llama

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr(model_runner_module, "position_logprobs", fail)
    monkeypatch.setattr(model_runner_module, "prompt_logprobs", fail)
    prompts = random_prompts({"a": 7, "b": 12}, VOCAB)
    requests = [logprob_request("a", prompts["a"]),
                logprob_request("b", prompts["b"], temperature=0.8, seed=3)]
    out, _ = run_core(runner, requests, max_num_batched_tokens=8)
    for updates in out.values():
        assert all(not u.new_logprobs and not u.prompt_logprobs for u in updates)
