"""Pooling models through the HTTP door of a real cluster (`corestream serve
--http-port`): an embedder (a sentence-transformers folder) driven by the official
`openai` client and checked against sentence-transformers, and a cross-encoder (a
one-label classifier) on vLLM's /v1/score, /v1/rerank and /classify, checked against
transformers; the tasks /v1/models lists, and bad input, which answers 400 naming the
body's field. Two clusters in all."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from tests.integration.cluster import Cluster, free_port
from tests.unit.engine.pooling_checkpoints import make_classifier, make_embedder

pytestmark = pytest.mark.timeout(300)

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 12,
         "Paris is the capital of France.", "a"]
QUERY = "capital of France"
DOCUMENTS = ["Paris is the capital.", "Bananas are yellow.", "France borders Spain.",
             "The capital of France is Paris, a city on the Seine."]


class Served:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        http_port = free_port()
        self.cluster = Cluster(["--model", str(folder), "--engines", "1",
                                "--http-port", str(http_port)])
        self.base = f"http://127.0.0.1:{http_port}"
        self.model = self.models()[0]["id"]
        self.openai = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused",
                                    max_retries=0, timeout=60)

    def models(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.base}/v1/models", timeout=30).json()["data"]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.base + path, json={"model": self.model, **body}, timeout=60)

    def close(self) -> None:
        self.openai.close()
        self.cluster.stop()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Served, SentenceTransformer]]:
    folder = tmp_path_factory.mktemp("embedder") / "st"
    st = make_embedder(folder, "qwen3", "MEAN", normalize=True, prompts={"query": "query: "})
    served = Served(folder)
    try:
        yield served, st
    finally:
        served.close()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Served, PreTrainedModel]]:
    folder = tmp_path_factory.mktemp("reranker")
    hf = make_classifier(folder, "llama", num_labels=1)
    served = Served(folder)
    try:
        yield served, hf
    finally:
        served.close()


def _cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _error(response: httpx.Response, param: str, *words: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


# --- embeddings ------------------------------------------------------------------------


def test_openai_client_embeddings_equal_sentence_transformers(embedder: tuple) -> None:
    served, st = embedder
    theirs = st.encode(TEXTS, convert_to_numpy=True)
    # Not told a format, the SDK asks for base64 and decodes it itself; float as asked.
    for extra in ({}, {"encoding_format": "float"}):
        reply = served.openai.embeddings.create(model=served.model, input=TEXTS, **extra)
        assert [e.index for e in reply.data] == list(range(len(TEXTS)))
        for ours, ref in zip(reply.data, theirs, strict=True):
            assert len(ours.embedding) == 64 and _cosine(ours.embedding, ref) >= 0.99999
        ids = st.tokenize(TEXTS)["attention_mask"].sum(dim=1).tolist()
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(ids)
        assert reply.model == served.model
    # Asked for base64, it hands the string on: little-endian float32 bytes.
    one = served.openai.embeddings.create(model=served.model, input=TEXTS[2],
                                          encoding_format="base64")
    assert len(one.data) == 1 and isinstance(one.data[0].embedding, str)
    values = np.frombuffer(base64.b64decode(one.data[0].embedding), dtype="<f4")
    assert _cosine(values, theirs[2]) >= 0.99999
    # Token ids: one list, or several.
    ids = [st.tokenize([t])["input_ids"][0].tolist() for t in TEXTS[:2]]
    flat = served.openai.embeddings.create(model=served.model, input=ids[0])
    assert _cosine(flat.data[0].embedding, theirs[0]) >= 0.99999
    nested = served.openai.embeddings.create(model=served.model, input=ids)
    for ours, ref in zip(nested.data, theirs[:2], strict=True):
        assert _cosine(ours.embedding, ref) >= 0.99999
    # Matryoshka: the first 16 values, normalized again.
    short = served.openai.embeddings.create(model=served.model, input=TEXTS[:2], dimensions=16)
    for ours, ref in zip(short.data, theirs[:2], strict=True):
        assert len(ours.embedding) == 16 and _cosine(ours.embedding, ref[:16]) >= 0.99999
        assert abs(np.linalg.norm(ours.embedding) - 1) < 1e-5


def test_the_wire_shapes_of_embeddings(embedder: tuple) -> None:
    served, st = embedder
    ref = st.encode(TEXTS[:1], convert_to_numpy=True)[0]
    raw = served.post("/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert body["metadata"] == {"weight_version": "0"}
    values = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert _cosine(values, ref) >= 0.99999
    # vLLM's names: no model (the served one), use_activation for normalize; ours:
    # prompt_name.
    raw = httpx.post(served.base + "/v1/embeddings", timeout=60, json={
        "input": TEXTS[0], "use_activation": False})
    assert raw.status_code == 200, raw.text
    plain = raw.json()["data"][0]["embedding"]
    assert abs(np.linalg.norm(plain) - 1) > 1e-3 and _cosine(plain, ref) >= 0.99999
    query = served.post("/v1/embeddings", {"input": TEXTS[0], "prompt_name": "query"}).json()
    ref = st.encode(TEXTS[:1], prompt_name="query", convert_to_numpy=True)[0]
    assert _cosine(query["data"][0]["embedding"], ref) >= 0.99999


def test_truncation_cuts_to_the_context(embedder: tuple) -> None:
    served, _ = embedder
    long = "word " * 600
    _error(served.post("/v1/embeddings", {"input": long}), "input", "set truncate")
    for extra in ({"truncate": True}, {"truncate_prompt_tokens": -1},
                  {"truncate_prompt_tokens": 512}):
        reply = served.post("/v1/embeddings", {"input": [long], **extra})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == 512
    _error(served.post("/v1/embeddings", {"input": long, "truncate_prompt_tokens": 10}),
           "truncate_prompt_tokens", "-1")


def test_score_of_an_embedder_is_cosine_similarity(embedder: tuple) -> None:
    served, st = embedder
    vectors = st.encode([TEXTS[2], *TEXTS], convert_to_numpy=True)
    for path in ("/v1/score", "/score"):
        reply = served.post(path, {"text_1": TEXTS[2], "text_2": TEXTS})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["model"] == served.model
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        assert all(d["object"] == "score" for d in body["data"])
        np.testing.assert_allclose([d["score"] for d in body["data"]],
                                   [_cosine(vectors[0], v) for v in vectors[1:]], atol=1e-5)
    # N:N goes pairwise.
    body = served.post("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()
    pairs = st.encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose([d["score"] for d in body["data"]],
                               [_cosine(pairs[0], pairs[2]), _cosine(pairs[1], pairs[3])],
                               atol=1e-5)


def test_models_lists_the_tasks_and_other_tasks_are_400(embedder: tuple) -> None:
    served, _ = embedder
    assert served.models()[0]["tasks"] == ["embed", "score"]
    with pytest.raises(openai.BadRequestError) as refused:
        served.openai.completions.create(model=served.model, prompt="hi", max_tokens=4)
    assert "serves embed and score, not generation" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        served.openai.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "hi"}])
    assert "not generation" in refused.value.message
    refused_ = served.post("/classify", {"input": "x"})
    assert refused_.status_code == 400
    error = refused_.json()["error"]
    assert "not classify" in error["message"] and error["code"] == "failed_precondition"


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/embeddings", {"input": []}, "input", "input is empty"),
    ("/v1/embeddings", {"input": ""}, "input", "input is an empty string"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input[1]", "input[1] is an empty string"),
    ("/v1/embeddings", {"input": [[]]}, "input[0]", "has no token ids"),
    ("/v1/embeddings", {"input": [1, 10**6]}, "input", "input[1] = 1000000 is out of the"),
    ("/v1/embeddings", {"input": ["a"] * 2049}, "input", "at most 2048"),
    ("/v1/embeddings", {"input": "a", "dimensions": 65}, "dimensions", "[1, 64]"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format", ""),
    ("/v1/embeddings", {"input": "a", "prompt_name": "passage"}, "prompt_name", "query"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2", "text_2 is empty"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1", "text_1 is empty"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2", "1:1, 1:N or N:N"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", ""]}, "text_2[1]", "empty string"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents", "documents is empty"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "query is an empty string"),
])
def test_bad_input_is_400_naming_the_field(embedder: tuple, path: str, body: dict[str, Any],
                                          param: str, words: str) -> None:
    served, _ = embedder
    _error(served.post(path, body), param, words)


# --- a cross-encoder -----------------------------------------------------------------


def _logits(served: Served, hf: PreTrainedModel, *texts: str) -> float:
    tokenizer = Tokenizer.from_file(str(served.folder / "tokenizer.json"))
    with torch.no_grad():
        return hf(torch.tensor([tokenizer.encode(*texts).ids])).logits[0, 0].item()


def _sigmoid(x: float) -> float:
    return 1 / (1 + np.exp(-x))


def test_rerank_and_score_equal_transformers(cross_encoder: tuple) -> None:
    served, hf = cross_encoder
    assert served.models()[0]["tasks"] == ["classify", "score"]
    expected = [_sigmoid(_logits(served, hf, QUERY, doc)) for doc in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/v1/rerank", "/rerank"):
        reply = served.post(path, {"query": QUERY, "documents": DOCUMENTS})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert [r["index"] for r in body["results"]] == order
        for result in body["results"]:
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-5
        assert body["usage"]["total_tokens"] > 0 and body["model"] == served.model
    top = served.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert [r["index"] for r in top.json()["results"]] == order[:2]
    scored = served.post("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    one = served.post("/score", {"text_1": [QUERY], "text_2": DOCUMENTS[0]}).json()
    assert len(one["data"]) == 1 and abs(one["data"][0]["score"] - expected[0]) < 1e-5


def test_classify_equals_transformers(cross_encoder: tuple) -> None:
    served, hf = cross_encoder
    logits = [_logits(served, hf, text) for text in DOCUMENTS]
    reply = served.post("/classify", {"input": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    for i, (data, logit) in enumerate(zip(body["data"], logits, strict=True)):
        assert data["index"] == i and data["label"] == "label-0" and data["num_classes"] == 1
        assert abs(data["probs"][0] - _sigmoid(logit)) < 1e-5
    raw = served.post("/v1/classify", {"input": DOCUMENTS[0], "use_activation": False}).json()
    assert abs(raw["data"][0]["probs"][0] - logits[0]) < 1e-4
    _error(served.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                      "use_activation": False}), "use_activation")
    refused = served.post("/v1/embeddings", {"input": "x"})
    assert refused.status_code == 400 and "not embed" in refused.json()["error"]["message"]
