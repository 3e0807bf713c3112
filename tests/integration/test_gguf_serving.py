"""`corestream serve --model <file.gguf>` on the real SmolLM2-135M-Instruct Q4_1: the
view's tokenizer and chat template reach the frontend, the engine reads the file's
weights, and a greedy answer to a factual question is right through ChatService and
through the OpenAI door. The engine's resident memory is logged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc

from tests.gguf_models import SMOLLM2_FILE
from tests.integration.cluster import Cluster, free_port

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(400)

# Qwen2.5's template: ChatML, as SmolLM2's own, plus tools in the system turn and calls
# as <tool_call>{...}</tool_call> (hermes style), which SmolLM2's template lacks.
HERMES_TEMPLATE = Path(__file__).resolve().parents[3] / "shared" / "chat_templates" / (
    "Qwen-Qwen2.5-7B-Instruct.jinja")

MODEL = Path(SMOLLM2_FILE).stem  # the name clients use: the file's
QUESTION = "What is the capital of France?"
# SmolLM2's first token for QUESTION is a 0.08-logit margin ("The" or "L'Étoile"). The
# second door asks it again, so the prompt hits the prefix cache and only its last rows
# are computed, through the few-row GEMV instead of the prefill's GEMM: the answer must
# not change (with one 8-bit pass over the activations it did).


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Cluster, int]]:
    http_port = free_port()
    cache = tmp_path_factory.mktemp("cache")
    c = Cluster(["--model", str(smollm2_gguf), "--engines", "1", "--max-model-len", "512",
                 "--kv-cache-memory", "64MiB",
                 "--http-port", str(http_port),
                 # For the tool call: a hermes-style template sent with the request.
                 "--trust-request-chat-template", "--tool-call-parser", "hermes"],
                startup_timeout=300,
                env={"CORESTREAM_CACHE_DIR": str(cache)})
    yield c, http_port
    c.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for {pid}")


def test_chat_service_answers(cluster: tuple[Cluster, int]) -> None:
    with grpc.insecure_channel(cluster[0].address) as channel:
        chat = chat_grpc.ChatServiceStub(channel)
        response = chat.Chat(chat_pb2.ChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content=QUESTION)],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=24)), timeout=120)
    [choice] = response.choices
    assert "Paris" in choice.content, choice
    assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_STOP


def test_openai_chat_completions_answer(cluster: tuple[Cluster, int]) -> None:
    _, http_port = cluster
    answers = []
    with openai_client(http_port) as client:
        [model] = client.models.list().data
        assert model.id == MODEL
        for _ in range(2):  # the second from the prefix cache
            completion = client.chat.completions.create(
                model=model.id, messages=[{"role": "user", "content": QUESTION}],
                temperature=0, max_tokens=24)
            [choice] = completion.choices
            assert "Paris" in (choice.message.content or ""), choice
            assert choice.finish_reason == "stop"
            answers.append(choice.message.content)
    assert answers[0] == answers[1]


def openai_client(http_port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def test_openai_json_schema_answer_validates(cluster: tuple[Cluster, int]) -> None:
    schema = {"type": "object", "properties": {"country": {"type": "string"},
                                               "capital": {"type": "string"}},
              "required": ["country", "capital"], "additionalProperties": False}
    with openai_client(cluster[1]) as client:
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content":
                                 QUESTION + " Answer in JSON with the country and its capital."}],
            temperature=0, max_tokens=64,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "capital", "schema": schema,
                                             "strict": True}})
    [choice] = completion.choices
    answer = json.loads(choice.message.content or "")
    jsonschema.validate(answer, schema)
    assert choice.finish_reason == "stop"
    print(f"json_schema answer: {answer}")


def test_openai_tool_call_with_a_hermes_template(cluster: tuple[Cluster, int]) -> None:
    if not HERMES_TEMPLATE.is_file():
        # The published templates are test data beside the repository (../shared), which a
        # bare clone lacks; the other tests that read them skip the same way.
        pytest.skip(f"shared chat template not found at {HERMES_TEMPLATE}")
    parameters = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": parameters}}
    with openai_client(cluster[1]) as client:
        completion = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            temperature=0, max_tokens=64, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            extra_body={"chat_template": HERMES_TEMPLATE.read_text()})
    [choice] = completion.choices
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters)
    assert choice.finish_reason == "tool_calls"
    print(f"tool call: {call.function.name}({arguments})")


def test_engine_memory_holds_quantized_weights(cluster: tuple[Cluster, int],
                                                 smollm2_gguf: Path) -> None:
    # The layers keep the file's blocks (92 MiB of a 94 MiB file; float32 would be 513).
    engine_rss = rss_mib(cluster[0].engine_pid(0))
    file_mib = smollm2_gguf.stat().st_size / 2**20
    print(f"engine RSS {engine_rss:.0f} MiB serving a {file_mib:.0f} MiB GGUF file")
    assert engine_rss < 3072, f"engine RSS {engine_rss:.0f} MiB"
