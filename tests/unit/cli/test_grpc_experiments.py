"""The gRPC client that the frontend runs (services/common/grpc_experiments.py): set
before grpc is imported, in the frontend only, an operator's own setting kept, and fewer
thread wake-ups for each streamed message than gRPC's default client."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[3]
MESSAGES = 200

# A client process as the frontend starts (`apply()` before grpc is imported), or with
# gRPC's default. It streams MESSAGES messages and prints its voluntary context switches
# (a thread going to sleep, which each wake-up ends with) per message.
CLIENT = textwrap.dedent("""
    import os, sys
    if sys.argv[2] == "frontend":
        from services.common import grpc_experiments
        grpc_experiments.apply()
    import asyncio, grpc

    def switches():
        total = 0
        for task in os.listdir("/proc/self/task"):
            try:
                status = open(f"/proc/self/task/{task}/status").read()
            except OSError:
                continue
            total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        return total

    async def main():
        async with grpc.aio.insecure_channel(sys.argv[1]) as channel:
            call = channel.unary_stream("/t.T/Stream")(b"")
            await call.read()
            before = switches()
            for _ in range(int(sys.argv[3])):
                await call.read()
            print((switches() - before) / int(sys.argv[3]))

    asyncio.run(main())
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _on_start(command: str, **env: str) -> list[str]:
    """[grpc imported before the command's package?, GRPC_EXPERIMENTS] of a process that
    runs `corestream <command>`."""
    code = ("import os, sys, services.cli; "  # argv: ["-c", command], as the command's
            "print('grpc' in sys.modules, os.environ.get('GRPC_EXPERIMENTS'))")
    done = subprocess.run([sys.executable, "-c", code, command], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_the_frontend_sets_the_client_before_grpc_and_keeps_an_operators_setting() -> None:
    assert _on_start("frontend") == ["False", "-event_engine_client"]
    assert _on_start("frontend", GRPC_EXPERIMENTS="-event_engine_listener") == [
        "False", "-event_engine_listener"]
    # Synchronous channels keep gRPC's default client (the module says why).
    for command in ("serve", "engine", "coordinator", "admin"):
        assert _on_start(command) == ["False", "None"], command


def _stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    # One small message every 2 ms, as an engine streams tokens: each finds the client
    # asleep, so each costs the client its wake-ups.
    for _ in range(MESSAGES + 1):
        time.sleep(0.002)
        yield b"token"


def _switches_per_message(address: str, client: str) -> float:
    done = subprocess.run([sys.executable, "-c", CLIENT, address, client, str(MESSAGES)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_a_streamed_message_wakes_fewer_client_threads_than_grpcs_default() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Stream": grpc.unary_stream_rpc_method_handler(_stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        ours = _switches_per_message(address, "frontend")
        default = _switches_per_message(address, "default")
    finally:
        server.stop(0)
    # Measured here 2.2 against 5.3 (a message read on the poller thread, against one read
    # on an EventEngine thread and handed over). A loaded machine batches reads (fewer
    # wake-ups for both), so the margin is the default's, not an absolute count.
    assert ours < 0.75 * default, (ours, default)
