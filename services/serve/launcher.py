"""`corestream serve`: the whole cluster as separate processes on 127.0.0.1.

Start order follows the dependencies: the coordinator, then the engines (which
register with it) and the frontend (which learns the engines from it as they come).
The launcher prints the frontend address once the frontend reports SERVING, then
watches its children. Stop order is the reverse, each child getting SIGTERM and the drain
timeout (--shutdown-timeout) plus --stop-timeout-s before SIGKILL, so that the
frontend drains while the engines still run and nothing is left behind.

serve is the supervisor on one machine (what the kubelet is in Kubernetes): a
child that exits without being asked to (a crash, SIGKILL, an OOM kill, the
watchdog) is restarted with exactly its old flags after a backoff (policy in
services/serve/restart_policy.py). The coordinator keeps its port, so engines re-register
and frontends leave degraded mode; an engine keeps its --engine-index (an MoE
expert-parallel group restarts as a whole, on a new rendezvous port); the
frontend keeps its port. A crash loop gives the part up: serve serves on
without an engine, and stops the cluster and exits non-zero for the coordinator,
the frontend or the last engine. Restarts are logged with their cause, counted
in `corestream:serve_restarts_total{part}` (on serve's one /metrics port for the
cluster, --metrics-port) and written to a status file that the frontend
reports in AdminService/GetEngineStats. Every child gets SIGTERM when serve
dies, even by SIGKILL (PR_SET_PDEATHSIG), and then drains as on any SIGTERM;
while serve stops the cluster nothing is restarted.

With --tls-auto, serve writes a throwaway CA and one certificate per process and
every link (the public port too, unless --no-require-client-cert) is mTLS; the
`client` certificate is for serve's own readiness checks and for the user's calls.
Otherwise the --tls-* flags, if given, go to every child as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coord_pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coord_grpc
from corestream.generate.v1 import generate_service_pb2 as gen_pb
from corestream.generate.v1 import generate_service_pb2_grpc as gen_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.auth import load_keys
from services.common.config import CONFIG_ERROR_EXIT, from_args, to_argv
from services.common.gguf_checkpoint import GGUF_FILE_KEY
from services.common.grpc_server import make_channel
from services.common.logs import setup_logging
from services.common.metrics import ConfigInfo, MetricsServer, new_registry
from services.common.observability_config import ObservabilityConfig
from services.common.pooling import PoolingConfig
from services.common.ports import free_port, port_in_use
from services.common.security_config import SecurityConfig
from services.common.shutdown import ShutdownSignal
from services.common.tiny_checkpoint import resolve_model
from services.coordinator.config import CoordinatorConfig
from services.engine.config import EngineConfig
from services.engine.kv_publisher.config import KvEventsConfig
from services.engine.models.registry import supported, unsupported_message
from services.engine.waves.config import DataParallelConfig
from services.engine.worker.config import RunnerConfig, format_cpu_list
from services.engine.worker.cpu_threads import threads_set_by_environment, usable_cpus
from services.frontend.config import FrontendConfig
from services.serve.config import SERVE_OWNED, ServeConfig
from services.serve.metrics import ClusterMetrics, scrape
from services.serve.restart_policy import RestartPolicy
from services.serve.supervision import GROUP_STOP_S, Child, Part, Supervision

log = logging.getLogger("services.serve")

HOST = "127.0.0.1"
STATE_PREFIX = "corestream-serve-"
FRONTEND_SERVICE = "corestream.generate.v1.GenerateService"
DP_MASTER_FLAG = "--data-parallel-master"
# Each stage of the start begins as soon as the one before is ready; the checks are
# local and cheap.
STARTUP_POLL_S = 0.05


def wait_until(check: Callable[[], bool], supervision: Supervision, deadline: float,
               stop: ShutdownSignal) -> bool:
    """Poll `check` until it holds, restarting children meanwhile; False on the deadline,
    shutdown or a part given up that the cluster cannot do without."""
    while time.monotonic() < deadline and not stop.is_set():
        if reason := supervision.check():
            log.error("the cluster cannot start: %s", reason)
            return False
        try:
            if check():
                return True
        except grpc.RpcError:
            pass  # not listening yet
        time.sleep(STARTUP_POLL_S)
    return False


def serving(channel: grpc.Channel, service: str) -> Callable[[], bool]:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    return lambda: (
        stub.Check(request, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
    )


def engines_running(channel: grpc.Channel, count: Callable[[], int]) -> Callable[[], bool]:
    stub = coord_grpc.CoordinatorServiceStub(channel)

    def check() -> bool:
        engines = stub.ListEngines(coord_pb.ListEnginesRequest(), timeout=1.0).engines
        return sum(e.state == common_pb2.ENGINE_STATE_RUNNING for e in engines) >= count()

    return check


def frontend_sees(channel: grpc.Channel, count: Callable[[], int], frontend: FrontendConfig
                  ) -> Callable[[], bool]:
    stub = gen_grpc.GenerateServiceStub(channel)
    # With client auth on, serve asks with one of the frontend's own keys.
    key_file = frontend.api_key_file or frontend.admin_api_key_file
    metadata = (("authorization", "Bearer " + load_keys(key_file)[0].decode()),) if key_file else ()
    return lambda: stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=1.0,
                                     metadata=metadata).num_engines >= count()


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
    args: argparse.Namespace, model: str, restart_status_file: str = ""
) -> tuple[ServeConfig, list[Child], str, SecurityConfig]:
    """The children to start, each with exactly its own flags, and how serve itself
    dials them. The coordinator's port is fixed here, so that a restart reuses it."""
    serve = from_args(ServeConfig, args)
    security = security_plan(serve, args)
    coordinator_port = serve.coordinator_port or free_port()
    coordinator_addr = f"{HOST}:{coordinator_port}"
    coordinator = from_args(CoordinatorConfig, args, exclude=SERVE_OWNED)
    runner = from_args(RunnerConfig, args, exclude=SERVE_OWNED)
    if (serve.engines > 1 and runner.num_threads == 0 and not runner.device.startswith("cuda")
            and not threads_set_by_environment()):
        # Engines on one machine share its CPUs: each gets its own share of threads, or
        # their operators would keep waiting on threads the others displaced.
        runner = dataclasses.replace(runner,
                                     num_threads=max(1, usable_cpus() // serve.engines))
    frontend = dataclasses.replace(from_args(FrontendConfig, args, exclude=SERVE_OWNED),
                                   restart_status_file=restart_status_file)
    if frontend.http_port == 0:
        # Chosen here, like the coordinator's, so the banner can name it and a restarted
        # frontend keeps it.
        frontend = dataclasses.replace(frontend, http_port=free_port())
    engine = from_args(EngineConfig, args, exclude=SERVE_OWNED)
    observability = to_argv(from_args(ObservabilityConfig, args, exclude=SERVE_OWNED))
    pooling = to_argv(from_args(PoolingConfig, args, exclude=SERVE_OWNED))
    kv_events = to_argv(from_args(KvEventsConfig, args, exclude=SERVE_OWNED))

    def private_metrics() -> list[str]:
        # Each child's own port; serve's endpoint reads them all (services/serve/metrics.py).
        return (["--metrics-port", str(free_port()), "--metrics-host", HOST]
                if serve.metrics_port else [])

    children = [
        Child("coordinator", ["coordinator", *to_argv(coordinator),
                              *to_argv(security["coordinator"]), *observability, *private_metrics(),
                              "--host", HOST, "--port", str(coordinator_port)]),
    ]
    # MoE models split their experts over the ranks (dense ones ignore these flags).
    dp = to_argv(from_args(DataParallelConfig, args, exclude=SERVE_OWNED))
    if serve.engines > 1:
        # Tensor-parallel rank r of each engine meets its group on port + r.
        dp += ["--data-parallel-size", str(serve.engines),
               DP_MASTER_FLAG, f"{HOST}:{free_port(count=runner.tensor_parallel_size)}"]
    for index, placed in enumerate(place_engines(runner, serve.engines)):
        children.append(Child(f"engine-{index}", [
            "engine", *to_argv(engine), *to_argv(placed), *dp, *pooling, *kv_events,
            *to_argv(security["engine"]),
            *observability, *private_metrics(), "--model", model,
            "--host", HOST, "--port", "0", "--engine-index", str(index),
            "--coordinator", coordinator_addr,
        ]))
    children.append(Child("frontend", [
        "frontend", *to_argv(frontend), *pooling, *to_argv(security["frontend"]), *observability,
        *private_metrics(), "--model", model,
        "--host", serve.host, "--port", str(serve.port), "--coordinator", coordinator_addr,
    ]))
    return serve, children, coordinator_addr, security["client"]


def place_engines(runner: RunnerConfig, engines: int) -> list[RunnerConfig]:
    """Each engine's runner settings, on hardware of its own: on CUDA its
    tensor_parallel_size devices after the previous engine's; on CPU (unless the operator
    chose a cpu_set) an equal share of serve's CPUs, which its ranks split again, so
    that no two engines' threads compete for a CPU."""
    tp = runner.tensor_parallel_size
    if runner.device.startswith("cuda"):
        first = int(runner.device.removeprefix("cuda").removeprefix(":") or 0)
        return [dataclasses.replace(runner, device=f"cuda:{first + e * tp}")
                for e in range(engines)]
    cpus = sorted(os.sched_getaffinity(0))
    if engines == 1 or runner.cpu_set or len(cpus) < engines:
        return [runner] * engines
    share = len(cpus) // engines
    return [dataclasses.replace(runner, cpu_set=format_cpu_list(tuple(cpus[e * share:][:share])))
            for e in range(engines)]


def splits_experts(config: dict[str, Any]) -> bool:
    """Whether the checkpoint (its config.json: serve stays torch-free) is an MoE model,
    whose experts the engines split."""
    return max(config.get("num_local_experts", 0), config.get("num_experts", 0)) > 1


def parts(children: list[Child], moe_group: bool, ports_per_group: int = 1) -> list[Part]:
    """What restarts as one: each process, except the ranks of an MoE group, which
    can only rendezvous together, on fresh ports (the old ones may still be held; each
    engine's TP rank r meets on port + r, `ports_per_group` in all)."""
    coordinator, *engines, frontend = children

    def new_group() -> None:
        address = f"{HOST}:{free_port(count=ports_per_group)}"
        for engine in engines:
            engine.argv[engine.argv.index(DP_MASTER_FLAG) + 1] = address
        # NOTE: the coordinator's wave relay replays the last wave start it relayed to
        # a rank that subscribes; a fresh rank (at wave 0) would join the old group's
        # wave alone and time out in its first collective. A fresh coordinator (same
        # port; the frontend is degraded for a moment) has no such memory.
        log.info("restarting the coordinator with the MoE group (it holds the old "
                 "group's wave state)")
        coordinator.stop(GROUP_STOP_S)
        coordinator.start()

    engine_parts = ([Part("engines", engines, essential=False, before_restart=new_group,
                          replaces_ranks=True)]
                    if moe_group else [Part(e.name, [e], essential=False) for e in engines])
    return [Part("coordinator", [coordinator], essential=True), *engine_parts,
            Part("frontend", [frontend], essential=True)]


def serve_metrics_registry(serve: ServeConfig, children: list[Child]
                           ) -> tuple[CollectorRegistry | None, MetricsServer | None]:
    """serve's one /metrics for the cluster: its own metrics (restart counts) and every
    child's, read from their private ports on each scrape."""
    if not serve.metrics_port:
        return None, None
    own = new_registry()
    own.register(ConfigInfo("serve", [serve]))
    sources = [("serve", own.collect)] + [
        (child.name, scrape(int(child.argv[child.argv.index("--metrics-port") + 1])))
        for child in children]
    endpoint = CollectorRegistry()
    endpoint.register(ClusterMetrics(sources))
    server = MetricsServer(endpoint)
    # A busy port raises PortUnavailable, which names it and the flag.
    server.start(ObservabilityConfig(metrics_port=serve.metrics_port), serve.host)
    return own, server


def busy_ports(serve: ServeConfig, children: list[Child]) -> str | None:
    """The first fixed port of the plan that something else already holds, named with
    its holder and the flag that moves it; None when all are free. Checked before any
    process starts: a busy port is no crash for restarts to cure."""
    frontend = children[-1].argv
    wanted = [(serve.host, serve.port, "--port")] if serve.port else []
    if "--http-port" in frontend and int(http := frontend[frontend.index("--http-port") + 1]) > 0:
        wanted.append((serve.host, int(http), "--http-port"))
    if serve.coordinator_port:
        wanted.append((HOST, serve.coordinator_port, "--coordinator-port"))
    if serve.metrics_port:
        wanted.append((serve.host, serve.metrics_port, "--metrics-port"))
    for host, port, flag in wanted:
        if reason := port_in_use(host, port):
            return f"{reason}; pass {flag}"
    return None


def checkpoint_config(model: str) -> dict[str, Any]:
    """The checkpoint's config.json; refused (ValueError) when no engine could load the
    checkpoint, before any engine starts."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model {model!r}: cannot read its config.json: {e}") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise ValueError(
            f"model {model!r}: config.json names no `architectures` (e.g. "
            '["LlamaForCausalLM"]), so no model class can be chosen for it')
    if supported(list(config["architectures"])) is None:
        raise ValueError(f"model {model!r}: {unsupported_message(list(config['architectures']))}")
    return config


def remove_dead_serves_state(temp_dir: Path) -> None:
    """Remove the state folders of serves that died without cleaning up (SIGKILL):
    each is named after its serve's pid."""
    for folder in temp_dir.glob(f"{STATE_PREFIX}*"):
        pid = folder.name.removeprefix(STATE_PREFIX).split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _failure(supervision: Supervision) -> int:
    return CONFIG_ERROR_EXIT if supervision.config_error else 1


def _dial_host(host: str) -> str:
    """How serve reaches a port that listens on `host`."""
    return HOST if host in ("0.0.0.0", "::", "[::]") else host


def _http_banner(frontend_argv: list[str], host: str) -> str:
    """Where the frontend serves the HTTP API, from its own flags ('' when off)."""
    if "--http-port" not in frontend_argv:
        return ""
    port = frontend_argv[frontend_argv.index("--http-port") + 1]
    if int(port) < 0:
        return ""
    # The HTTP port serves TLS exactly when the frontend's gRPC port does.
    scheme = "https" if "--tls-cert" in frontend_argv else "http"
    return f", OpenAI-compatible HTTP on {scheme}://{host}:{port}/v1"


def run(args: argparse.Namespace) -> int:
    setup_logging("serve", getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    stop = ShutdownSignal.install()
    # Write the built-in checkpoint once here, not racily in every child.
    model = str(resolve_model(args.model or None))
    config = checkpoint_config(model)
    if args.quantization != "none" and GGUF_FILE_KEY in config:
        raise ValueError(f"--quantization {args.quantization} quantizes a safetensors "
                         f"checkpoint; {config[GGUF_FILE_KEY]} is a GGUF file, served with "
                         "its own quantization: drop --quantization")
    temp_dir = Path(tempfile.gettempdir())
    remove_dead_serves_state(temp_dir)
    state_dir = Path(tempfile.mkdtemp(prefix=f"{STATE_PREFIX}{os.getpid()}-", dir=temp_dir))
    try:
        return _run(args, model, config, state_dir, stop)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _run(args: argparse.Namespace, model: str, config: dict[str, Any], state_dir: Path,
         stop: ShutdownSignal) -> int:
    status_file = state_dir / "restarts.json"
    serve, children, coordinator_addr, client = plan(args, model, str(status_file))
    if reason := busy_ports(serve, children):
        raise ValueError(reason)
    frontend_addr = f"{_dial_host(serve.host)}:{serve.port}"
    coordinator, *engines, frontend = children
    registry, metrics_server = serve_metrics_registry(serve, children)
    policy = RestartPolicy(serve.max_restarts, serve.restart_window_s, serve.restart_backoff_max_s)
    tensor_parallel_size = from_args(RunnerConfig, args, exclude=SERVE_OWNED).tensor_parallel_size
    supervision = Supervision(parts(children, serve.engines > 1 and splits_experts(config),
                                    tensor_parallel_size),
                              policy, status_file, registry)
    coordinator_part, *engine_parts, frontend_part = supervision.parts
    deadline = time.monotonic() + serve.startup_timeout_s
    try:
        with make_channel(coordinator_addr, client) as to_coordinator, \
                make_channel(frontend_addr, client) as to_frontend:
            # Each stage waits for the one before, so "serving" means every engine is in
            # (but one given up in a crash loop). The frontend starts with the engines: it
            # learns them from the coordinator as they register, and its start (~0.6 s of
            # imports) then overlaps their model loads instead of following them.
            stages = [
                ([coordinator_part], serving(to_coordinator, "")),
                ([*engine_parts, frontend_part],
                 engines_running(to_coordinator, lambda: supervision.num_engines)),
                ([], serving(to_frontend, FRONTEND_SERVICE)),
                ([], frontend_sees(to_frontend, lambda: supervision.num_engines,
                                   from_args(FrontendConfig, args, exclude=SERVE_OWNED))),
            ]
            for to_start, ready in stages:
                for part in to_start:
                    supervision.start(part)
                if not wait_until(ready, supervision, deadline, stop):
                    if not stop.is_set() and time.monotonic() >= deadline:
                        log.error("the cluster did not become ready within %.0fs",
                                  serve.startup_timeout_s)
                    return 0 if stop.is_set() else _failure(supervision)
        http = _http_banner(frontend.argv, serve.host)
        metrics = (f", metrics on http://{serve.host}:{serve.metrics_port}/metrics"
                   if serve.metrics_port else "")
        print(f"corestream is serving on {serve.host}:{serve.port} "
              f"(model {model}, {supervision.num_engines} engine(s){http}{metrics}); "
              "Ctrl-C stops it", flush=True)
        while not stop.wait(0.2):
            if reason := supervision.check():
                log.error("stopping the cluster: %s", reason)
                return _failure(supervision)
        return 0
    finally:
        # Nothing is restarted from here on: supervision.check() is not called again.
        drain_s = from_args(FrontendConfig, args, exclude=SERVE_OWNED).shutdown_timeout
        log.info("stopping the cluster (drain timeout %g s)", drain_s)
        for child in reversed(children):
            child.stop(drain_s + serve.stop_timeout_s)
        if metrics_server is not None:
            metrics_server.stop()
        log.info("all processes stopped")
