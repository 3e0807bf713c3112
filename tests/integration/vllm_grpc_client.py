"""A client of vLLM's gRPC engine API built on the official stubs (the smg-grpc-proto
package), run in a process of its own by tests/integration/test_vllm_grpc.py:

    python -m tests.integration.vllm_grpc_client ADDRESS SCENARIO [ARGS_JSON]

prints one JSON object. Its own process because the package registers the same
protobuf names (vllm.grpc.engine.*, smg.grpc.common.*) as the frontend's vendored
code, which the unit tests import; one process cannot hold both.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from typing import Any

import grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

Json = dict[str, Any]
TIMEOUT_S = 60.0


def as_json(message: Message) -> Json:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def error_json(error: grpc.RpcError) -> Json:
    assert isinstance(error, grpc.Call)
    return {"code": error.code().name, "details": error.details()}


def generate(stub: vllm_engine_pb2_grpc.VllmEngineStub, request: Json) -> Json:
    """The responses of one Generate call, or its error."""
    message = json_format.ParseDict(request, vllm_engine_pb2.GenerateRequest())
    try:
        return {"responses": [as_json(r) for r in stub.Generate(message, timeout=TIMEOUT_S)]}
    except grpc.RpcError as e:
        return {"error": error_json(e)}


def info(stub: vllm_engine_pb2_grpc.VllmEngineStub, _: Json) -> Json:
    # The frontend reads each engine's KV-cache size on its own schedule (every few
    # seconds until known): GetLoads reports 0 until then.
    _wait_for(lambda: all(load.max_total_num_tokens > 0 for load in stub.GetLoads(
        vllm_engine_pb2.GetLoadsRequest(), timeout=10).loads))
    return {
        "health": as_json(stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10)),
        "model": as_json(stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)),
        "server": as_json(stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(),
                                             timeout=10)),
        "loads": as_json(stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=10)),
        # Idle engines flush at once; the timeout covers a request another test left.
        "flush": as_json(stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=20),
                                         timeout=30)),
    }


def abort(stub: vllm_engine_pb2_grpc.VllmEngineStub, args: Json) -> Json:
    """A request held in its engine's queue by a keep pause (so it cannot finish first,
    however fast the engine), aborted through Abort once the frontend runs it."""
    admin = admin_grpc.AdminServiceStub(grpc.insecure_channel(args["address"]))
    admin.PauseScheduling(admin_pb2.PauseSchedulingRequest(mode=admin_pb2.PAUSE_MODE_KEEP),
                          timeout=20)
    result: Json = {}
    try:
        stream = threading.Thread(target=lambda: result.update(generate(stub, args["request"])))
        stream.start()
        _wait_for(lambda: stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(),
                                             timeout=10).active_requests == 1)
        stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[args["request"]["request_id"]]),
                   timeout=10)
        stream.join(TIMEOUT_S)
        result["active_after"] = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(),
                                                    timeout=10).active_requests
    finally:
        admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(), timeout=20)
    return result


def tokenizer(stub: vllm_engine_pb2_grpc.VllmEngineStub, _: Json) -> Json:
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT_S))
    data = b"".join(c.data for c in chunks)
    archive = zipfile.ZipFile(io.BytesIO(data))
    return {
        "num_chunks": len(chunks),
        "sha256s": [c.sha256 for c in chunks],
        "sha256": hashlib.sha256(data).hexdigest(),
        "members": {name: hashlib.sha256(archive.read(name)).hexdigest()
                    for name in archive.namelist()},
    }


def kv_events(stub: vllm_engine_pb2_grpc.VllmEngineStub, args: Json) -> Json:
    """Subscribe from the history's start (so that nothing the request stores can be
    missed however late the subscription lands), run the request, and read until a
    batch stores the prompt's first block; then resume from that batch's number."""
    first_block = args["request"]["tokenized"]["input_ids"][:args["block_size"]]
    subscription = stub.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=1), timeout=TIMEOUT_S)
    generated = generate(stub, args["request"])
    batches: list[Json] = []
    found = None
    for batch in subscription:
        batches.append(as_json(batch))
        for event in batch.events:
            if event.HasField("stored") and any(
                    list(b.token_ids) == first_block for b in event.stored.blocks):
                found = batch
        if found is not None:
            break
    subscription.cancel()
    assert found is not None
    resumed = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=found.sequence_number), timeout=TIMEOUT_S)
    again = next(iter(resumed))
    resumed.cancel()
    return {"generated": generated, "batches": batches, "found": as_json(found),
            "resumed": as_json(again)}


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def paused(stub: vllm_engine_pb2_grpc.VllmEngineStub, args: Json) -> Json:
    """GetServerInfo's is_paused before, during and after a keep pause of every engine."""
    with grpc.insecure_channel(args["address"]) as channel:
        admin = admin_grpc.AdminServiceStub(channel)

        def is_paused() -> bool:
            return stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(),
                                      timeout=10).is_paused

        before = is_paused()
        admin.PauseScheduling(admin_pb2.PauseSchedulingRequest(
            mode=admin_pb2.PAUSE_MODE_KEEP), timeout=TIMEOUT_S)
        try:
            during = is_paused()
        finally:
            admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(), timeout=TIMEOUT_S)
        return {"before": before, "during": during, "after": is_paused()}


SCENARIOS: dict[str, Callable[[vllm_engine_pb2_grpc.VllmEngineStub, Json], Json]] = {
    "generate": lambda stub, args: generate(stub, args["request"]), "info": info,
    "abort": abort, "tokenizer": tokenizer, "kv_events": kv_events, "paused": paused,
}


def main() -> None:
    address, scenario = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    with grpc.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        print(json.dumps(SCENARIOS[scenario](stub, {"address": address, **args})))


if __name__ == "__main__":
    main()
