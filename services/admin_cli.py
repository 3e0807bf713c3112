"""`corestream admin`: call the frontend's AdminService and print the results as JSON.

Torch-free: it needs only grpc and the generated protos. Exits 1 when any engine
reports a failure, so that scripts can tell.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_pb2_grpc

from services.common.auth import with_api_key
from services.common.config import add_arguments as add_config_arguments
from services.common.config import from_args
from services.common.grpc_server import make_channel
from services.common.security_config import SecurityConfig

COMMANDS = ("reset-prefix-cache", "stats", "pause", "resume", "profile-start", "profile-stop")
PAUSE_MODES = {"abort": admin_pb2.PAUSE_MODE_ABORT, "wait": admin_pb2.PAUSE_MODE_WAIT,
               "keep": admin_pb2.PAUSE_MODE_KEEP}

_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, metavar="HOST:PORT",
                        help="The frontend's address.")
    parser.add_argument("action", choices=COMMANDS)
    parser.add_argument("--mode", choices=tuple(PAUSE_MODES), default="wait",
                        help="For pause: abort all requests, let running ones finish "
                        "(wait, the default), or freeze them (keep).")
    parser.add_argument("--engine", type=int, default=None, metavar="N",
                        help="Only the engine with this data-parallel rank (default: all).")
    parser.add_argument("--timeout", type=float, default=30.0, help="RPC deadline in seconds.")
    parser.add_argument("--api-key-file", default="", metavar="FILE",
                        help="Send the first key in FILE as 'authorization: Bearer' (the "
                        "frontend's --admin-api-key-file, when it has one).")
    # --tls-cert/--tls-key/--tls-ca: the client certificate for an mTLS frontend.
    add_config_arguments(parser, SecurityConfig, exclude=("health_host", "health_port"))


def _result_to_dict(r: admin_pb2.EngineResult) -> dict[str, Any]:
    out: dict[str, Any] = {"engine_index": r.engine_index, "address": r.address, "ok": r.ok}
    if r.ok:
        out["result"] = json.loads(r.result_json) if r.result_json else None
    else:
        out["code"] = _CODE_NAMES.get(r.code, str(r.code))
        out["message"] = r.message
    return out


def run(args: argparse.Namespace) -> int:
    engine = {} if args.engine is None else {"engine_index": args.engine}
    security = from_args(SecurityConfig, args, exclude=("health_host", "health_port"))
    with make_channel(args.address, security) as plain:
        channel = with_api_key(plain, args.api_key_file) if args.api_key_file else plain
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        try:
            if args.action == "reset-prefix-cache":
                reply = stub.ResetPrefixCache(admin_pb2.ResetPrefixCacheRequest(**engine),
                                              timeout=args.timeout)
            elif args.action == "stats":
                reply = stub.GetEngineStats(admin_pb2.GetEngineStatsRequest(**engine),
                                            timeout=args.timeout)
            elif args.action == "pause":
                reply = stub.PauseScheduling(admin_pb2.PauseSchedulingRequest(
                    mode=PAUSE_MODES[args.mode], **engine), timeout=args.timeout)
            elif args.action == "resume":
                reply = stub.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(**engine),
                                              timeout=args.timeout)
            elif args.action == "profile-start":
                reply = stub.StartProfile(admin_pb2.StartProfileRequest(**engine),
                                          timeout=args.timeout)
            else:
                reply = stub.StopProfile(admin_pb2.StopProfileRequest(**engine),
                                         timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"corestream admin {args.action}: {e.code().name}: {e.details()}",
                  file=sys.stderr)
            return 1
    results = [_result_to_dict(r) for r in reply.results]
    print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1
