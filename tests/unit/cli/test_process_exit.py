"""The process entry's exit (services.cli.main.exit_process): what the interpreter's own
exit does first still happens, only the teardown of modules is skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_threads_are_joined_atexit_runs_and_piped_output_is_flushed() -> None:
    # stdout is a pipe here, so block-buffered: nothing reaches it without the flush.
    code = textwrap.dedent("""
        import atexit, sys, threading, time
        from services.cli.main import exit_process
        atexit.register(lambda: print("atexit ran", end="; "))
        def late() -> None:
            time.sleep(0.3)
            print("thread done", end="; ")
        threading.Thread(target=late).start()
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        print("main done", end="; ")
        sys.stderr.write("to stderr")
        exit_process(3)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 3, done.stderr
    # The non-daemon thread ended before the atexit callbacks ran; the daemon one was
    # not waited for (60 s), as at any exit.
    assert done.stdout == "main done; thread done; atexit ran; ", done.stdout
    assert done.stderr == "to stderr"
