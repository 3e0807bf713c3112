"""`corestream serve`: the whole cluster as separate processes on 127.0.0.1.

Start order follows the dependencies: coordinator, then engines (which register
with it), then the frontend (which learns the engines from it). The launcher
prints the frontend address once the frontend reports SERVING, then watches its
children. Stop order is the reverse, each child getting SIGTERM and the drain
timeout (--shutdown-timeout) plus --stop-timeout-s before SIGKILL, so that the
frontend drains while the engines still run and nothing is left behind.

An engine that dies on its own is logged and left dead while another engine
still serves (the frontend routes around it); when the last engine, the
frontend or the coordinator dies, the cluster is stopped and serve exits
non-zero, so that a supervisor restarts it. Every child gets SIGTERM when serve
dies, even by SIGKILL (PR_SET_PDEATHSIG), and then drains as on any SIGTERM.

With --tls-auto, serve writes a throwaway CA and one certificate per process and
every link (the public port too, unless --no-require-client-cert) is mTLS; the
`client` certificate is for serve's own readiness checks and for the user's calls.
Otherwise the --tls-* flags, if given, go to every child as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coord_pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coord_grpc
from corestream.generate.v1 import generate_service_pb2 as gen_pb
from corestream.generate.v1 import generate_service_pb2_grpc as gen_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import load_keys
from services.common.config import from_args, to_argv
from services.common.grpc_server import make_channel
from services.common.logs import setup_logging
from services.common.observability_config import ObservabilityConfig
from services.common.parent_death import child_env
from services.common.security_config import SecurityConfig
from services.common.shutdown import ShutdownSignal
from services.common.tiny_checkpoint import resolve_model
from services.coordinator.config import CoordinatorConfig
from services.engine.config import EngineConfig
from services.engine.dp_config import DataParallelConfig
from services.engine.worker.config import RunnerConfig
from services.engine.worker.cpu_threads import threads_set_by_environment, usable_cpus
from services.frontend.config import FrontendConfig
from services.serve_config import SERVE_OWNED, ServeConfig

log = logging.getLogger("services.serve")

HOST = "127.0.0.1"
FRONTEND_SERVICE = "corestream.generate.v1.GenerateService"
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = field(default=None)

    def start(self) -> None:
        cmd = [sys.executable, "-m", "services.cli", *self.argv]
        log.info("starting %s: %s", self.name, " ".join(self.argv))
        # A session of its own: a terminal's Ctrl-C reaches serve alone, which
        # then stops the children in order.
        # Children get SIGTERM if serve itself is killed, even with SIGKILL (set up by the
        # child: see services/common/parent_death.py).
        self.proc = subprocess.Popen(cmd, start_new_session=True,
                                     env={**os.environ, **child_env()})

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.0fs of SIGTERM; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait()


def wait_until(
    check: Callable[[], bool], children: Sequence[Child], deadline: float, stop: ShutdownSignal
) -> bool:
    """Poll `check` until it holds; False on the deadline, shutdown or a dead child."""
    while time.monotonic() < deadline and not stop.is_set():
        for child in children:
            if child.exited() is not None:
                log.error("%s exited with code %s during startup", child.name, child.exited())
                return False
        try:
            if check():
                return True
        except grpc.RpcError:
            pass  # not listening yet
        time.sleep(0.2)
    return False


def serving(channel: grpc.Channel, service: str) -> Callable[[], bool]:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    return lambda: (
        stub.Check(request, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
    )


def engines_running(channel: grpc.Channel, count: int) -> Callable[[], bool]:
    stub = coord_grpc.CoordinatorServiceStub(channel)

    def check() -> bool:
        engines = stub.ListEngines(coord_pb.ListEnginesRequest(), timeout=1.0).engines
        return sum(e.state == common_pb2.ENGINE_STATE_RUNNING for e in engines) >= count

    return check


def frontend_sees(channel: grpc.Channel, count: int, frontend: FrontendConfig
                  ) -> Callable[[], bool]:
    stub = gen_grpc.GenerateServiceStub(channel)
    # With client auth on, serve asks with one of the frontend's own keys.
    key_file = frontend.api_key_file or frontend.admin_api_key_file
    metadata = (("authorization", "Bearer " + load_keys(key_file)[0].decode()),) if key_file else ()
    return lambda: stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=1.0,
                                     metadata=metadata).num_engines >= count


def security_plan(serve: ServeConfig, args: argparse.Namespace) -> dict[str, SecurityConfig]:
    """The SecurityConfig of each role: coordinator, engine, frontend and client (serve)."""
    given = from_args(SecurityConfig, args, exclude=SERVE_OWNED)
    roles = ("coordinator", "engine", "frontend", "client")
    if not serve.tls_auto:
        # Client certificates stay required between the services: the public port is
        # the only one that may take clients without one.
        internal = dataclasses.replace(given, require_client_cert=True)
        return {**dict.fromkeys(roles, internal), "frontend": given}
    if given.tls:
        raise ValueError(
            "--tls-auto makes its own certificates: drop --tls-cert/--tls-key/--tls-ca")
    # Imported here: only --tls-auto needs the cryptography package.
    from services.common.certs import write_local_pki

    directory = Path(serve.tls_dir or tempfile.mkdtemp(prefix="corestream-tls-"))
    configs = {role: dataclasses.replace(c, reflection=given.reflection)
               for role, c in write_local_pki(directory, roles).items()}
    configs["frontend"] = dataclasses.replace(
        configs["frontend"], require_client_cert=given.require_client_cert)
    log.info("--tls-auto: TLS everywhere, client certificates required %s; CA and "
             "certificates in %s", "everywhere" if given.require_client_cert else
             "between the services", directory)
    return configs


def plan(
    args: argparse.Namespace, model: str
) -> tuple[ServeConfig, list[Child], str, SecurityConfig]:
    """The children to start, each with exactly its own flags, and how serve itself
    dials them."""
    serve = from_args(ServeConfig, args)
    security = security_plan(serve, args)
    coordinator_port = serve.coordinator_port or free_port()
    coordinator_addr = f"{HOST}:{coordinator_port}"
    coordinator = from_args(CoordinatorConfig, args, exclude=SERVE_OWNED)
    runner = from_args(RunnerConfig, args, exclude=SERVE_OWNED)
    if (serve.engines > 1 and runner.num_threads == 0 and runner.device != "cuda"
            and not threads_set_by_environment()):
        # Engines on one machine share its CPUs: each gets its own share of threads, or
        # their operators would keep waiting on threads the others displaced.
        runner = dataclasses.replace(runner,
                                     num_threads=max(1, usable_cpus() // serve.engines))
    frontend = from_args(FrontendConfig, args, exclude=SERVE_OWNED)
    engine = from_args(EngineConfig, args, exclude=SERVE_OWNED)
    observability = to_argv(from_args(ObservabilityConfig, args, exclude=SERVE_OWNED))

    def metrics_port(offset: int) -> list[str]:
        return ["--metrics-port", str(serve.metrics_port + offset)] if serve.metrics_port else []

    children = [
        Child("coordinator", ["coordinator", *to_argv(coordinator),
                              *to_argv(security["coordinator"]), *observability, *metrics_port(0),
                              "--host", HOST, "--port", str(coordinator_port)]),
    ]
    # MoE models split their experts over the ranks (dense ones ignore these flags).
    dp = to_argv(from_args(DataParallelConfig, args, exclude=SERVE_OWNED))
    if serve.engines > 1:
        dp += ["--data-parallel-size", str(serve.engines),
               "--data-parallel-master", f"{HOST}:{free_port()}"]
    for index in range(serve.engines):
        children.append(Child(f"engine-{index}", [
            "engine", *to_argv(engine), *to_argv(runner), *dp, *to_argv(security["engine"]),
            *observability, *metrics_port(2 + index), "--model", model,
            "--host", HOST, "--port", "0", "--engine-index", str(index),
            "--coordinator", coordinator_addr,
        ]))
    children.append(Child("frontend", [
        "frontend", *to_argv(frontend), *to_argv(security["frontend"]), *observability,
        *metrics_port(1), "--model", model,
        "--host", HOST, "--port", str(serve.port), "--coordinator", coordinator_addr,
    ]))
    return serve, children, coordinator_addr, security["client"]


def run(args: argparse.Namespace) -> int:
    setup_logging("serve", getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    stop = ShutdownSignal.install()
    # Write the built-in checkpoint once here, not racily in every child.
    model = str(resolve_model(args.model or None))
    serve, children, coordinator_addr, client = plan(args, model)
    frontend_addr = f"{HOST}:{serve.port}"
    http_port = getattr(args, "http_port", -1)
    coordinator, *engines, frontend = children
    deadline = time.monotonic() + serve.startup_timeout_s
    try:
        with make_channel(coordinator_addr, client) as to_coordinator, \
                make_channel(frontend_addr, client) as to_frontend:
            # Each stage waits for the one before, so "serving" means every engine is in.
            stages = [
                ([coordinator], serving(to_coordinator, "")),
                (engines, engines_running(to_coordinator, len(engines))),
                ([frontend], serving(to_frontend, FRONTEND_SERVICE)),
                ([], frontend_sees(to_frontend, len(engines),
                                   from_args(FrontendConfig, args, exclude=SERVE_OWNED))),
            ]
            for to_start, ready in stages:
                for child in to_start:
                    child.start()
                if not wait_until(ready, children, deadline, stop):
                    if not stop.is_set():
                        log.error("the cluster did not become ready within %.0fs",
                                  serve.startup_timeout_s)
                    return 0 if stop.is_set() else 1
        http = (f", OpenAI-compatible HTTP on http://{HOST}:{http_port}/v1"
                if http_port > 0 else "")
        print(f"corestream is serving on {frontend_addr} "
              f"(model {model}, {serve.engines} engine(s){http}); Ctrl-C stops it", flush=True)
        reported: set[str] = set()
        while not stop.wait(0.5):
            for c in children:
                if c.exited() is not None and c.name not in reported:
                    reported.add(c.name)
                    log.error("%s exited unexpectedly with code %s", c.name, c.exited())
            if any(c.exited() is not None for c in (coordinator, frontend)) or all(
                    e.exited() is not None for e in engines):
                return 1
        return 0
    finally:
        drain_s = from_args(FrontendConfig, args, exclude=SERVE_OWNED).shutdown_timeout
        log.info("stopping the cluster (drain timeout %g s)", drain_s)
        for child in reversed(children):
            child.stop(drain_s + serve.stop_timeout_s)
        log.info("all processes stopped")
