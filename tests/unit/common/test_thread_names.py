"""Native thread names: what top -H, ps -L and perf show for our threads."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.common.thread_names import name_native_thread, native_thread_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="native thread names are read from /proc")


def test_a_thread_names_itself_up_to_the_kernels_15_bytes() -> None:
    seen: dict[str, str] = {}

    def target() -> None:
        seen["before"] = native_thread_name()
        name_native_thread()
        seen["after"] = native_thread_name()

    thread = threading.Thread(target=target, name="engine-watchdog-and-more")
    thread.start()
    thread.join()
    assert seen["before"] != "engine-watchdog"
    assert seen["after"] == "engine-watchdog"  # the first 15 bytes


def test_a_pool_names_its_workers_through_the_initializer() -> None:
    with ThreadPoolExecutor(2, thread_name_prefix="grpc",
                            initializer=name_native_thread) as pool:
        names = {pool.submit(native_thread_name).result() for _ in range(8)}
    assert names <= {"grpc_0", "grpc_1"} and names


def test_the_main_thread_keeps_the_process_name() -> None:
    # Renaming the main thread would rename the process in ps and top.
    with open("/proc/self/comm") as f:
        process_name = f.read().strip()
    assert native_thread_name(threading.main_thread().native_id) == process_name
