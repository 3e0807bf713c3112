"""`corestream admin`: call the frontend's AdminService and print the results as JSON.

Torch-free: it needs only grpc and the generated protos. Exits 1 when any engine
reports a failure, so that scripts can tell.

Under `corestream serve`, `stats` also shows serve's restarts: each engine's entry
gets `restarts` and `last_exit`, and the coordinator and frontend follow the
engines as entries of their own (`part`, `ok` false once serve gave up on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

import grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_pb2_grpc

from services.common.auth import with_api_key
from services.common.config import from_args
from services.common.grpc_server import make_channel
from services.common.security_config import SecurityConfig

# action -> (AdminService method, its request message)
COMMANDS: dict[str, tuple[str, type[Any]]] = {
    "reset-prefix-cache": ("ResetPrefixCache", admin_pb2.ResetPrefixCacheRequest),
    "stats": ("GetEngineStats", admin_pb2.GetEngineStatsRequest),
    "pause": ("PauseScheduling", admin_pb2.PauseSchedulingRequest),
    "resume": ("ResumeScheduling", admin_pb2.ResumeSchedulingRequest),
    "profile-start": ("StartProfile", admin_pb2.StartProfileRequest),
    "profile-stop": ("StopProfile", admin_pb2.StopProfileRequest),
    "is-paused": ("IsPaused", admin_pb2.IsPausedRequest),
    "update-weights": ("UpdateWeightsFromDisk", admin_pb2.UpdateWeightsFromDiskRequest),
    "weight-info": ("GetWeightInfo", admin_pb2.GetWeightInfoRequest),
    "abort-weight-update": ("AbortWeightUpdate", admin_pb2.AbortWeightUpdateRequest),
    "sleep": ("Sleep", admin_pb2.SleepRequest),
    "wake-up": ("WakeUp", admin_pb2.WakeUpRequest),
    "is-sleeping": ("IsSleeping", admin_pb2.IsSleepingRequest),
    "fault-status": ("GetFaultStatus", admin_pb2.GetFaultStatusRequest),
    "fault-recover": ("RecoverFault", admin_pb2.RecoverFaultRequest),
    "fault-abort": ("AbortFault", admin_pb2.AbortFaultRequest),
}
# Calls that reach every engine: no --engine.
_ALL_ENGINES = ("update-weights", "abort-weight-update")
PAUSE_MODES = {"abort": admin_pb2.PAUSE_MODE_ABORT, "wait": admin_pb2.PAUSE_MODE_WAIT,
               "keep": admin_pb2.PAUSE_MODE_KEEP}

_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
# SecurityConfig fields that only mean something to a server.
_SERVER_ONLY = ("health_host", "health_port", "require_client_cert", "reflection")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", metavar="HOST:PORT",
                        help="The frontend's gRPC address (default: %(default)s, where "
                        "`corestream serve` puts it).")
    parser.add_argument("action", choices=tuple(COMMANDS))
    parser.add_argument("--mode", choices=tuple(PAUSE_MODES), default="wait",
                        help="For pause: abort all requests, let running ones finish "
                        "(wait, the default: answers once they have, within --timeout), or "
                        "freeze them (keep).")
    parser.add_argument("--clear-cache", action="store_true",
                        help="For pause: drop the prefix cache once paused.")
    parser.add_argument("--path", default="", metavar="FOLDER",
                        help="For update-weights: a folder of *.safetensors files (all of the "
                        "model's tensors or some) that every engine swaps in at once.")
    parser.add_argument("--weight-version", default=None, metavar="VERSION",
                        help="For update-weights: the version the new weights serve as "
                        "(default: the old one plus one).")
    parser.add_argument("--level", type=int, choices=(1, 2), default=1,
                        help="For sleep: 1 frees the KV cache (the default), 2 the weights too "
                        "(wake-up reloads them, or an update replaces them).")
    parser.add_argument("--tags", nargs="+", choices=("kv_cache", "weights"), default=[],
                        help="For wake-up: what to restore (default: both).")
    parser.add_argument("--engine", type=int, default=None, metavar="N",
                        help="Only the engine with this data-parallel rank (default: all).")
    parser.add_argument("--timeout", type=float, default=30.0, help="RPC deadline in seconds.")
    parser.add_argument("--api-key-file", default="", metavar="FILE",
                        help="Send the first key in FILE as 'authorization: Bearer' (the "
                        "frontend's --admin-api-key-file, when it has one).")
    # The names of SecurityConfig's fields, with what they mean to a client.
    parser.add_argument("--tls-ca", default="", metavar="PEM",
                        help="Call over TLS, trusting the frontend's certificate when this CA "
                        "bundle signed it (ca.pem in serve's --tls-dir under --tls-auto); "
                        "needs --tls-cert and --tls-key.")
    parser.add_argument("--tls-cert", default="", metavar="PEM",
                        help="Client certificate to present to a frontend that requires one "
                        "(client.pem under --tls-auto).")
    parser.add_argument("--tls-key", default="", metavar="PEM",
                        help="Private key of --tls-cert (client.key under --tls-auto).")


def _result_to_dict(r: admin_pb2.EngineResult) -> dict[str, Any]:
    out: dict[str, Any] = {"engine_index": r.engine_index, "address": r.address, "ok": r.ok}
    if r.ok:
        out["result"] = json.loads(r.result_json) if r.result_json else None
    else:
        out["code"] = _CODE_NAMES.get(r.code, str(r.code))
        out["message"] = r.message
    return out


def _with_restarts(results: list[dict[str, Any]],
                   restarts: Iterable[admin_pb2.ProcessRestarts]) -> list[dict[str, Any]]:
    parts = {r.part: {"restarts": r.restarts, "last_exit": r.last_exit, "given_up": r.given_up}
             for r in restarts}
    for result in results:
        # An MoE group restarts as one part ("engines").
        part = parts.get(f"engine-{result['engine_index']}", parts.get("engines"))
        if part is not None:
            result.update(restarts=part["restarts"], last_exit=part["last_exit"])
    return results + [{"part": name, "ok": not part["given_up"], **part}
                      for name, part in parts.items() if not name.startswith("engine")]


def run(args: argparse.Namespace) -> int:
    security = from_args(SecurityConfig, args, exclude=_SERVER_ONLY)
    with make_channel(args.address, security) as plain:
        channel = with_api_key(plain, args.api_key_file) if args.api_key_file else plain
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        method, request_class = COMMANDS[args.action]
        fields: dict[str, Any] = ({} if args.engine is None or args.action in _ALL_ENGINES
                                  else {"engine_index": args.engine})
        deadline = args.timeout
        if args.action == "pause":
            fields.update(mode=PAUSE_MODES[args.mode], clear_cache=args.clear_cache,
                          timeout_s=args.timeout)
            deadline += 5  # room for the engines' answers after their wait ends
        if args.action == "sleep":
            fields["level"] = args.level
        if args.action == "wake-up":
            fields["tags"] = args.tags
        if args.action == "update-weights":
            fields["path"] = args.path
            if args.weight_version is not None:
                fields["weight_version"] = args.weight_version
        try:
            reply = getattr(stub, method)(request_class(**fields), timeout=deadline)
        except grpc.RpcError as e:
            print(f"corestream admin {args.action}: {e.code().name}: {e.details()}",
                  file=sys.stderr)
            return 1
    results = [_result_to_dict(r) for r in reply.results]
    if args.action == "stats":
        results = _with_restarts(results, reply.restarts)
    print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1
