"""schemathesis against the HTTP door of a real cluster, from the door's own OpenAPI
document (`GET /openapi.json`, openapi.py).

For every operation the document describes, schemathesis draws requests that fit the
schema (positive) and requests that break it (negative), and each answer must be:
no 5xx, a status the document declares for that operation, a declared content type,
and, for a failure, OpenAI's error body. Afterwards the openai client still gets a
completion and no process of the cluster has died.

The frontend runs with small caps (max_tokens 16, OpenAI's default; n 4; 1 MiB bodies) so that the
requests that are valid stay cheap, and with keys: the fuzzer sends the admin key, so
that it gets past authentication, except to the RL routes that change the engines'
state (pause, sleep, weight transfers and updates), which it reaches with the plain
API key and so only ever as a 401: random weight updates would end the cluster's
ability to serve, and a random transfer group would wait on an address for minutes.
Their bodies' parsing is checked by the targeted cases below instead.

FUZZ_EXAMPLES per operation and mode run in the default suite (derandomized, so the
same requests every run), SLOW_FUZZ_EXAMPLES under -m slow.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CheckContext
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.common.ports import free_port
from services.common.tiny_checkpoint import TINY_CHECKPOINT_NAME
from tests.integration.cluster import Cluster, alive, descendants

FUZZ_EXAMPLES = 20
SLOW_FUZZ_EXAMPLES = 5_000  # per mode: 10,000 per operation
# The long run takes the operations with the widest bodies: on two busy cores its
# 60,000 requests took 35 minutes (about 29 a second); all 33 operations would take
# more than three hours.
SLOW_SURFACES = frozenset({"/v1/completions", "/v1/chat/completions", "/generate",
                           "/v1/embeddings", "/v1/score", "/v1/rerank"})
ADMIN_KEY = "sk-fuzz-admin"
API_KEY = "sk-fuzz-api"
MAX_MESSAGE_BYTES = 1 << 20
# The RL routes that change what the engines serve: fuzzed with the API key (401 only).
STATEFUL_ADMIN = frozenset({
    "/pause", "/resume", "/sleep", "/wake_up", "/init_weight_transfer_engine",
    "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/abort_weight_update", "/update_weights_from_disk",
})

pytestmark = pytest.mark.timeout(3600)


class Door:
    """A cluster with its HTTP door, and the door's OpenAPI document loaded."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "keys").write_text(API_KEY + "\n")
        (tmp / "admin").write_text(ADMIN_KEY + "\n")
        http_port = free_port()
        self.cluster = Cluster([
            "--engines", "1", "--http-port", str(http_port),
            "--max-tokens-limit", "16", "--max-n", "4",
            "--max-message-bytes", str(MAX_MESSAGE_BYTES),
            "--api-key-file", str(tmp / "keys"), "--admin-api-key-file", str(tmp / "admin")])
        self.base = f"http://127.0.0.1:{http_port}"
        self.pids = descendants(self.cluster.proc.pid)
        self.schema = schemathesis.openapi.from_url(f"{self.base}/openapi.json")
        self.statuses: Counter[tuple[str, int]] = Counter()

    def headers(self, path: str) -> dict[str, str]:
        key = API_KEY if path in STATEFUL_ADMIN else ADMIN_KEY
        return {"Authorization": f"Bearer {key}"}

    def dead(self) -> list[int]:
        return [pid for pid in self.pids if not alive(pid)]


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    door = Door(tmp_path_factory.mktemp("http_fuzz"))
    yield door
    door.cluster.stop()


def openai_error_body(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    """Every failure answers in OpenAI's shape, and every answer names its request id."""
    assert response.headers.get("x-request-id"), "no X-Request-Id"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
    return None


def _no_server_error(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    # schemathesis' own not_a_server_error re-reads its config; this one is plain.
    assert response.status_code < 500, f"{response.status_code}: {response.text[:2000]}"
    return None


CHECKS = [_no_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, openai_error_body]


def _fuzz(door: Door, examples: int, paths: frozenset[str] | None = None) -> None:
    started = time.monotonic()
    for result in door.schema.get_all_operations():
        operation = result.ok()
        if paths is not None and operation.path not in paths:
            continue
        # Those only ever answer 401 here: a few examples show it.
        count = min(examples, 3) if operation.path in STATEFUL_ADMIN else examples
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz_operation(door, operation, mode, count)
            except Unsatisfiable:
                # Nothing to break: no body and no parameters (GET /v1/models).
                assert mode is GenerationMode.NEGATIVE
    spent = time.monotonic() - started
    by_status = Counter[int]()
    for (_, status), count in door.statuses.items():
        by_status[status] += count
    operations = len({label for label, _ in door.statuses})
    print(f"\n{by_status.total()} requests over {operations} operations in {spent:.1f} s; "
          f"statuses: {dict(sorted(by_status.items()))}")


def _fuzz_operation(door: Door, operation: Any, mode: GenerationMode, examples: int) -> None:
    headers = door.headers(operation.path)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=True)
    def one(case: Any) -> None:
        response = case.call(base_url=door.base, headers=headers, timeout=60)
        door.statuses[(case.operation.label, response.status_code)] += 1
        case.validate_response(response, checks=CHECKS, headers=headers)

    one()


def _still_serves(door: Door) -> None:
    with openai.OpenAI(base_url=f"{door.base}/v1", api_key=ADMIN_KEY, max_retries=0,
                       timeout=60) as client:
        done = client.completions.create(model=client.models.list().data[0].id,
                                         prompt="hello", max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert not door.dead(), f"processes died:\n{door.cluster.output()}"


def test_schemathesis_finds_no_undocumented_answer(door: Door) -> None:
    _fuzz(door, FUZZ_EXAMPLES)
    _still_serves(door)


@pytest.mark.slow
def test_schemathesis_long_run(door: Door) -> None:
    _fuzz(door, SLOW_FUZZ_EXAMPLES, SLOW_SURFACES)
    _still_serves(door)


# Refused before any engine is asked: safe to send with the admin key. Each was a 500.
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/sleep?level=%C2%B2", None, "level"),  # "²": str.isdigit yes, int() no
    ("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2,
        "timeout_s": 10**400}}, "init_info.timeout_s"),  # float() overflowed
    ("/update_weights", "[" * 50_000, "body"),  # json's RecursionError
])
def test_rl_bodies_that_were_server_errors(door: Door, path: str, body: Any,
                                           param: str) -> None:
    content = body if isinstance(body, str) else None
    response = httpx.post(door.base + path, headers=door.headers("/is_paused"),
                          json=body if content is None and body is not None else None,
                          content=content, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_streamed_answers_fit_the_document(door: Door, path: str) -> None:
    # The long run found the event stream's schema wrong (events are objects to
    # schemathesis); the short run rarely draws a valid streamed request.
    bodies = {
        "/v1/completions": {"prompt": "hello"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
    }
    model = door.schema[path]["POST"]
    case = model.Case(body={"model": TINY_CHECKPOINT_NAME, "stream": True, **bodies[path]},
                      media_type="application/json")
    headers = door.headers(path)
    response = case.call(base_url=door.base, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(response, checks=CHECKS, headers=headers)
