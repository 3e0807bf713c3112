"""Children of `corestream serve` exit when serve dies, even by SIGKILL.

serve cannot arrange this between fork and exec: a `preexec_fn` makes Python fork
the whole process, and the gRPC channels serve already holds do not survive a fork
(the child can abort in gRPC's fork handler before it ever runs). So serve names
itself in an environment variable and each child, first thing, asks the kernel
for SIGTERM when its parent goes (PR_SET_PDEATHSIG), then checks that the parent
has not gone already.
"""

from __future__ import annotations

import ctypes
import os
import signal

ENV_VAR = "CORESTREAM_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """What a child needs in its environment to die with this process."""
    return {ENV_VAR: str(os.getpid())}


def die_with_parent_from_env() -> None:
    """If started by serve, get SIGTERM when serve dies (read once, at start)."""
    parent = os.environ.pop(ENV_VAR, "")
    if not parent.isdigit():
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return  # not Linux: no such guarantee
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)  # serve died before we asked
