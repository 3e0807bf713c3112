"""Pooling engines against their references on the same random weights:
sentence-transformers' `encode` for embedders (every pooling mode, with and without
normalization), transformers' `AutoModelForSequenceClassification` for classifiers.
Prompts longer than the step's token budget are prefilled in chunks, batched with
short ones; a LAST-pooled prompt seen before is served from the prefix cache."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

from services.common.pooling import (
    PoolingConfig,
    PoolingParams,
    PoolingTask,
    PoolingType,
    resolve_pooler,
)
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.request import FAILED_PRECONDITION, INVALID_ARGUMENT, FinishReason, Request
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.fakes import collect
from tests.unit.engine.pooling_checkpoints import CONTEXT, make_classifier, make_embedder

pytestmark = pytest.mark.timeout(300)

BUDGET = 32
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog, " * 6,  # past the budget: chunked
    "a",
    "Paris is the capital of France. " * 3,
]
_ids = itertools.count()


def _engine(folder: Path, max_concurrent_batches: int = 1) -> EngineCore:
    pooler = resolve_pooler(folder)
    assert pooler is not None
    runner = ModelRunner(RunnerConfig(model=str(folder), kv_cache_memory="16MiB",
                                      max_model_len=CONTEXT), pooler=pooler)
    runner.warmup()
    return EngineCore(EngineConfig(max_num_batched_tokens=BUDGET,
                                   max_concurrent_batches=max_concurrent_batches), runner)


def _pool(core: EngineCore, token_ids: list[list[int]], params: PoolingParams
          ) -> list[np.ndarray]:
    """Every input in one go (batched, chunked); the results in input order."""
    session = f"s{next(_ids)}"
    q = core.sessions.open(session)
    rids = [f"r{next(_ids)}" for _ in token_ids]
    for rid, ids in zip(rids, token_ids, strict=True):
        core.add_request(Request(rid, list(ids), SamplingParams(), session_id=session,
                                 pooling=params))
    by_id, _ = collect(q, set(rids), timeout=60)
    core.sessions.close(session)
    out = []
    for rid in rids:
        last = by_id[rid][-1]
        assert last.finish_reason is FinishReason.LENGTH and not last.error_message, last
        out.append(np.frombuffer(last.pooled, dtype=np.float32).reshape(last.pooled_shape))
    return out


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[EngineCore, SentenceTransformer, Tokenizer]]:
    folder = tmp_path_factory.mktemp("pool") / "qwen3-last"
    st = make_embedder(folder, "qwen3", "LAST", normalize=True)
    core = _engine(folder)
    core.start()
    yield core, st, Tokenizer.from_file(str(folder / "tokenizer.json"))
    core.shutdown()


def _reference(st: SentenceTransformer, texts: list[str], kind: str,
               normalize: bool) -> list[np.ndarray]:
    """sentence-transformers' token states of the same model, pooled as `kind`."""
    tokens = st.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    pooled = []
    for t in tokens:
        t = t.float()
        vec = {"LAST": t[-1], "MEAN": t.mean(0), "CLS": t[0], "ALL": t}[kind]
        if normalize:
            vec = torch.nn.functional.normalize(vec, dim=-1)
        pooled.append(vec.numpy())
    return pooled


def test_the_checkpoints_pooling_equals_sentence_transformers(embedder: tuple) -> None:
    core, st, tok = embedder
    ids = [tok.encode(t).ids for t in TEXTS]
    assert max(map(len, ids)) > BUDGET
    ours = _pool(core, ids, PoolingParams(PoolingTask.EMBED))
    theirs = st.encode(TEXTS, convert_to_numpy=True)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape == (64,)
        assert _cosine(a, b) >= 0.99999
        np.testing.assert_allclose(a, b, atol=1e-4)
        assert abs(np.linalg.norm(a) - 1) < 1e-5


@pytest.mark.parametrize(("kind", "normalize"), [
    ("MEAN", False), ("MEAN", True), ("CLS", False), ("CLS", True), ("LAST", False),
    ("ALL", False), ("ALL", True)])
def test_every_pooling_mode_per_request(embedder: tuple, kind: str, normalize: bool) -> None:
    core, st, tok = embedder
    ids = [tok.encode(t).ids for t in TEXTS]
    ours = _pool(core, ids, PoolingParams(PoolingTask.EMBED, PoolingType[kind], normalize))
    for a, b in zip(ours, _reference(st, TEXTS, kind, normalize), strict=True):
        assert a.shape == b.shape
        for row_a, row_b in zip(np.atleast_2d(a), np.atleast_2d(b), strict=True):
            assert _cosine(row_a, row_b) >= 0.99999
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_dimensions_truncate_then_renormalize(embedder: tuple) -> None:
    core, st, tok = embedder
    full = st.encode(TEXTS[:2], convert_to_numpy=True)
    ours = _pool(core, [tok.encode(t).ids for t in TEXTS[:2]],
                 PoolingParams(PoolingTask.EMBED, dimensions=16))
    for a, b in zip(ours, full, strict=True):
        expected = b[:16] / np.linalg.norm(b[:16])
        assert a.shape == (16,) and _cosine(a, expected) >= 0.99999
        assert abs(np.linalg.norm(a) - 1) < 1e-5


def test_a_last_pooled_prompt_seen_before_comes_from_the_prefix_cache(embedder: tuple) -> None:
    core, _, tok = embedder
    ids = tok.encode(TEXTS[1]).ids
    first = _pool(core, [ids], PoolingParams(PoolingTask.EMBED))[0]
    session = f"s{next(_ids)}"
    q = core.sessions.open(session)
    core.add_request(Request("again", ids, SamplingParams(), session_id=session,
                             pooling=PoolingParams(PoolingTask.EMBED)))
    by_id, _ = collect(q, {"again"}, timeout=60)
    again = by_id["again"][-1]
    assert again.num_cached_tokens >= len(ids) - 8  # all full blocks but the last token's
    np.testing.assert_allclose(np.frombuffer(again.pooled, dtype=np.float32), first,
                               atol=1e-5)


def test_mismatched_requests_are_refused_and_the_engine_serves_on(embedder: tuple) -> None:
    core, st, tok = embedder
    session = f"s{next(_ids)}"
    q = core.sessions.open(session)
    core.add_request(Request("gen", [1, 2, 3], SamplingParams(max_tokens=2),
                             session_id=session))
    core.add_request(Request("cls", [1, 2, 3], SamplingParams(), session_id=session,
                             pooling=PoolingParams(PoolingTask.CLASSIFY)))
    core.add_request(Request("dims", [1, 2, 3], SamplingParams(), session_id=session,
                             pooling=PoolingParams(PoolingTask.EMBED, dimensions=65)))
    by_id, _ = collect(q, {"gen", "cls", "dims"})
    assert by_id["gen"][-1].error_code == FAILED_PRECONDITION
    assert "serves embed and score, not generation" in by_id["gen"][-1].error_message
    assert by_id["cls"][-1].error_code == FAILED_PRECONDITION
    assert by_id["dims"][-1].error_code == INVALID_ARGUMENT
    assert "dimensions must be in [1, 64]" in by_id["dims"][-1].error_message
    ours = _pool(core, [tok.encode(TEXTS[0]).ids], PoolingParams(PoolingTask.EMBED))[0]
    assert _cosine(ours, st.encode(TEXTS[:1], convert_to_numpy=True)[0]) >= 0.99999


@pytest.mark.parametrize(("family", "kind", "normalize", "depth"), [
    ("llama", "MEAN", False, 1), ("qwen2", "CLS", True, 1), ("llama", "MEAN", False, 2)])
def test_sentence_transformers_folders_of_other_families(
        tmp_path: Path, family: str, kind: str, normalize: bool, depth: int) -> None:
    # depth 2: the next chunk of a prompt is scheduled while the last one executes.
    st = make_embedder(tmp_path / "st", family, kind, normalize=normalize)
    pooler = resolve_pooler(tmp_path / "st")
    assert pooler is not None
    assert (pooler.pooling_type, pooler.normalize) == (PoolingType[kind], normalize)
    tok = Tokenizer.from_file(str(tmp_path / "st" / "tokenizer.json"))
    core = _engine(tmp_path / "st", depth)
    core.start()
    try:
        ours = _pool(core, [tok.encode(t).ids for t in TEXTS], PoolingParams(PoolingTask.EMBED))
    finally:
        core.shutdown()
    for a, b in zip(ours, st.encode(TEXTS, convert_to_numpy=True), strict=True):
        assert _cosine(a, b) >= 0.99999
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_an_auto_kv_cache_holds_max_num_seqs_prompts_for_a_pooling_model(
        tmp_path: Path) -> None:
    # Pooled requests free their blocks at once: more than max_num_seqs whole prompts would
    # only hold prefix entries, and each block first written on CPU costs page faults.
    folder = tmp_path / "emb"
    make_embedder(folder, "qwen3", "LAST", normalize=True)
    pooler = resolve_pooler(folder)
    per_prompt = -(-CONTEXT // 16)
    sized = {}
    # The built-in tiny model generates: its auto cache is not capped.
    for model, memory, pooled in ((folder, "auto", pooler), ("", "auto", None),
                                  (folder, "16MiB", pooler)):
        runner = ModelRunner(RunnerConfig(model=str(model), kv_cache_memory=memory,
                                          max_model_len=CONTEXT, max_num_seqs=3),
                             pooler=pooled)
        sized[memory, pooled is not None] = runner.num_blocks
    assert sized["auto", True] == 3 * per_prompt
    # A generating engine's auto and an explicit size are the user's to keep.
    assert sized["auto", False] > 3 * per_prompt
    assert sized["16MiB", True] > 3 * per_prompt


@pytest.mark.parametrize(("family", "num_labels"), [("qwen3", 3), ("llama", 1), ("qwen2", 2)])
def test_classifiers_equal_transformers(tmp_path: Path, family: str, num_labels: int) -> None:
    hf = make_classifier(tmp_path / "cls", family, num_labels)
    pooler = resolve_pooler(tmp_path / "cls")
    assert pooler is not None and pooler.labels == tuple(f"label-{i}"
                                                          for i in range(num_labels))
    tok = Tokenizer.from_file(str(tmp_path / "cls" / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in TEXTS]
    core = _engine(tmp_path / "cls")
    core.start()
    try:
        probs = _pool(core, ids, PoolingParams(PoolingTask.CLASSIFY))
        logits = _pool(core, ids, PoolingParams(PoolingTask.CLASSIFY, activation=False))
    finally:
        core.shutdown()
    for one, p, raw in zip(ids, probs, logits, strict=True):
        with torch.no_grad():
            expected = hf(torch.tensor([one])).logits[0].float()
        np.testing.assert_allclose(raw, expected.numpy(), atol=1e-5, rtol=1e-5)
        act = torch.sigmoid(expected) if num_labels == 1 else torch.softmax(expected, -1)
        np.testing.assert_allclose(p, act.numpy(), atol=1e-5)


# (first, paraphrase) pairs; every other pair's second sentence is unrelated to `first`.
PARAPHRASES = [
    ("The cat sat on the mat.", "A cat was sitting on the mat."),
    ("How do I reset my password?", "What is the way to change my password?"),
    ("The weather is sunny today.", "Today the weather is sunny."),
    ("The train to London was late.", "The London train arrived late."),
    ("He bought a new car yesterday.", "Yesterday he purchased a new automobile."),
    ("The stock market fell sharply.", "Share prices dropped a lot."),
    ("I love eating pizza.", "Pizza is my favorite food."),
]


def test_smollm2_as_a_mean_pooling_embedder_ranks_paraphrases_first(
        smollm2_gguf: Path, smollm2_view: Path) -> None:
    # A real model (a GGUF file, quantized) served as an embedder by --runner pooling.
    pooler = resolve_pooler(smollm2_view, PoolingConfig(runner="pooling", pooling_type="MEAN"))
    assert pooler is not None and pooler.hidden_size == 576 and pooler.normalize
    runner = ModelRunner(RunnerConfig(model=str(smollm2_gguf), kv_cache_memory="64MiB",
                                      max_model_len=512), pooler=pooler)
    runner.warmup()
    core = EngineCore(EngineConfig(), runner)
    core.start()
    tok = Tokenizer.from_file(str(smollm2_view / "tokenizer.json"))
    try:
        vectors = _pool(core, [tok.encode(t).ids for pair in PARAPHRASES for t in pair],
                        PoolingParams(PoolingTask.EMBED))
    finally:
        core.shutdown()
    firsts, seconds = vectors[0::2], vectors[1::2]
    for i, (first, _) in enumerate(PARAPHRASES):
        paraphrase = float(np.dot(firsts[i], seconds[i]))
        unrelated = max(float(np.dot(firsts[i], seconds[j]))
                        for j in range(len(PARAPHRASES)) if j != i)
        # Measured on Zen 4: paraphrases 0.89-0.97, the closest unrelated 0.80-0.90 (at
        # least 0.025 below its paraphrase).
        assert paraphrase > unrelated, (first, paraphrase, unrelated)
