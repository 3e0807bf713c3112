"""`corestream`: one command for every process of the cluster.

    corestream coordinator | engine | frontend   run one service
    corestream serve                             run a whole cluster on 127.0.0.1
    corestream admin --address HOST:PORT ACTION  reset-prefix-cache, stats, pause, resume,
                                                 profile-start, profile-stop

Config modules are torch-free, so building the parsers never loads torch; a
service's code is imported only when that service runs.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from corestream_kernels.cpu_isa import apply_to_libraries

from services.cli.admin import add_arguments as add_admin_arguments
from services.cli.admin import run as run_admin
from services.common.config import CONFIG_ERROR_EXIT, add_arguments
from services.common.observability_config import ObservabilityConfig
from services.common.parent_death import die_with_parent_from_env
from services.common.pooling import PoolingConfig
from services.common.ports import PortUnavailable
from services.common.security_config import SecurityConfig
from services.coordinator.config import CoordinatorConfig
from services.engine.config import EngineConfig
from services.engine.kv_publisher.config import KvEventsConfig
from services.engine.waves.config import DataParallelConfig
from services.engine.worker.config import RunnerConfig
from services.frontend.config import FrontendConfig
from services.serve.config import SERVE_OWNED, ServeConfig

SERVICES: dict[str, tuple[tuple[type, ...], str, str]] = {
    "coordinator": ((CoordinatorConfig, SecurityConfig, ObservabilityConfig),
                    "services.coordinator.main", "Run the DP coordinator."),
    "engine": ((EngineConfig, RunnerConfig, DataParallelConfig, KvEventsConfig, PoolingConfig,
                SecurityConfig, ObservabilityConfig),
               "services.engine.main", "Run one engine-core."),
    "frontend": ((FrontendConfig, PoolingConfig, SecurityConfig, ObservabilityConfig),
                 "services.frontend.main", "Run the public frontend."),
}

# `serve --help` by part of the cluster; each flag goes to the process that owns it.
SERVE_GROUPS: tuple[tuple[str, str, tuple[type, ...]], ...] = (
    ("serve", "The launcher itself: ports, engine count, restarts.", (ServeConfig,)),
    ("frontend", "The public frontend: limits, routing, chat, the HTTP door.",
     (FrontendConfig,)),
    ("engine", "Each engine-core: model, scheduler, KV cache, threads, parallelism.",
     (EngineConfig, RunnerConfig, DataParallelConfig, KvEventsConfig)),
    ("coordinator", "The DP coordinator.", (CoordinatorConfig,)),
    ("pooling", "Pooling models (embeddings, classification, scores), for the engines and "
     "the frontend.", (PoolingConfig,)),
    ("observability", "Logs, metrics and traces, for every process.", (ObservabilityConfig,)),
    ("security", "TLS, client certificates and reflection, for every process.",
     (SecurityConfig,)),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corestream", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (classes, _, help_text) in SERVICES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        for cls in classes:
            add_arguments(p, cls)
    serve = sub.add_parser(
        "serve",
        help="Run coordinator, engines and frontend as separate processes on 127.0.0.1.",
        description="Run coordinator, engines and frontend as separate processes on 127.0.0.1; "
        "every flag of those services is accepted and passed to the process that owns it.",
    )
    for title, description, classes in SERVE_GROUPS:
        group = serve.add_argument_group(title, description)
        for cls in classes:
            add_arguments(group, cls, exclude=() if cls is ServeConfig else SERVE_OWNED)
    admin = sub.add_parser(
        "admin", help="Call a frontend's AdminService; prints JSON.",
        description="Call a frontend's AdminService (per engine: prefix-cache reset, "
        "statistics, pause and resume of scheduling) and print the results as JSON.")
    add_admin_arguments(admin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent_from_env()
    try:
        # Before anything imports torch: oneDNN and ATen read the caps once.
        apply_to_libraries()
    except ValueError as e:
        print(f"corestream: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from services.serve.launcher import run as run_serve

            return run_serve(args)
        if args.command == "admin":
            return run_admin(args)
        module = importlib.import_module(SERVICES[args.command][1])
        return int(module.run(args))
    except (ValueError, PortUnavailable) as e:
        # Config validation or a busy port: name the field, the limit or the port's
        # holder, no traceback.
        print(f"corestream {args.command}: {e}", file=sys.stderr)
        return CONFIG_ERROR_EXIT


def entry() -> NoReturn:
    """The process entry of `corestream` (its console script) and `python -m services.cli`."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """Ends the process as the interpreter's exit would, less the teardown of its modules.

    NOTE: a process that has imported torch spends ~0.45 s after its last line tearing
    its modules down (0.02 s without), and serve stops its children one after another:
    a cluster's stop took 0.7-0.9 s, 0.1-0.3 s without (Zen 4). Nothing of ours needs
    that teardown. What an exit must do still happens, in the interpreter's order:
    non-daemon threads are joined, then the atexit callbacks run (logging's flush,
    multiprocessing's joins, weakref finalizers, OpenTelemetry's exporters)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
