"""StepChannel: how a tensor-parallel leader hands each model call to its followers.

The leader (rank 0, in the engine process) runs the scheduler and the sampler; the
followers (worker processes, ranks 1..N-1) only mirror its model calls on their shards,
in the same order, so that every collective lines up. Each call is one message:

- the call's arrays (a step's flattened batch: token ids, positions, cache slots, block
  tables, ...) are written once into one shared-memory segment that every follower
  maps, never pickled or copied through a pipe;
- a small JSON header (the call's kind and where each array lies in the segment, a
  few hundred bytes whatever the batch) goes down one pipe per follower, which is also what
  wakes an idle follower: it blocks in a read, using no CPU, until the next step.

The leader overwrites the segment on the next call without waiting for an
acknowledgement. That is safe because every call ends in a collective that needs every
follower (a forward's all-reduces, the logits' all-gather), which a follower joins
only after it has copied its arrays out; so when the leader's call returns, every
follower is done reading. A batch larger than the segment moves to a new, larger one,
named in the header; the old file is unlinked one call later, when every follower has
certainly mapped the new one.

A call that needs no arrays but some words (a live weight update's step, `WEIGHTS`)
carries them in its header, `text`: a call without a collective must not leave anything
in the segment that the next call could overwrite before the follower read it.

The pipes carry the other direction too: a follower's one startup report (the KV
blocks it can afford, or why it could not start), the outcome of each weight-update
step, and, if it fails, why. A follower
counts the calls it has finished in a shared progress slot, so that a stall names the
rank that is behind.
"""

from __future__ import annotations

import contextlib
import enum
import json
import mmap
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

import numpy as np

_INITIAL_BYTES = 1 << 20
_ALIGN = 64
# One int64 per rank: calls finished. Rank 0's slot counts the leader's sends.
_PROGRESS_SLOTS = 64


class CallKind(enum.IntEnum):
    FORWARD = 1
    """A step's forward over its flattened batch."""
    LOGITS = 2
    """Logits at some rows of the last forward's hidden states."""
    DUMMY = 3
    """A forward over zero tokens (an idle expert-parallel rank)."""
    NUM_BLOCKS = 4
    """Startup: the KV blocks every rank allocates (the least any can afford)."""
    STOP = 5
    WEIGHTS = 6
    """A step of a live weight update (JSON in the call's text); answered by a report."""
    REFORM = 7
    """After a failed step of an expert-parallel group: re-form this engine's TP group
    (value 1), or the rank's DP group as the members in the text (JSON: rank 0's group
    decided them); answered by a report."""


@dataclass(frozen=True)
class Call:
    kind: CallKind
    arrays: dict[str, np.ndarray]
    value: int = 0
    text: str = ""


def _shm_dir() -> str:
    # /dev/shm is RAM on Linux; elsewhere (or where it is missing) any temp dir works,
    # only slower to page in.
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Segment:
    """A shared file mapped into memory; `path` is how another process maps it."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, size: int) -> _Segment:
        fd, path = tempfile.mkstemp(prefix="corestream-tp-", dir=_shm_dir())
        os.close(fd)
        os.unlink(path)  # mkstemp only picked a free name; O_EXCL recreates it below
        return cls(path, size, create=True)

    def close(self) -> None:
        # BufferError: a numpy view still points into it; the mapping goes with the process.
        with contextlib.suppress(BufferError):
            self.map.close()

    def unlink(self) -> None:
        Path(self.path).unlink(missing_ok=True)


class LeaderChannel:
    """The leader's end: one segment, one pipe per follower, the progress slots."""

    def __init__(self, num_followers: int) -> None:
        if not 0 < num_followers < _PROGRESS_SLOTS:
            raise ValueError(f"num_followers must be in [1, {_PROGRESS_SLOTS}), got "
                             f"{num_followers}")
        self._pipes = [Pipe(duplex=True) for _ in range(num_followers)]
        self._segment = _Segment.create(_INITIAL_BYTES)
        self._progress_segment = _Segment.create(8 * _PROGRESS_SLOTS)
        self._progress = np.frombuffer(self._progress_segment.map, dtype=np.int64)
        self._retired: list[_Segment] = []
        self._new_path: str | None = self._segment.path
        self._closed = False
        # Model calls come from the loop (or execute) thread; a weight update's steps
        # from other threads too: one call's header and arrays at a time.
        self._sending = threading.Lock()

    def follower_end(self, rank: int) -> FollowerChannel:
        """What follower `rank` (1..N-1) needs, picklable, for its process's arguments."""
        return FollowerChannel(rank, self._pipes[rank - 1][1], self._segment.path,
                               self._segment.size, self._progress_segment.path)

    @property
    def connections(self) -> list[Connection]:
        """The leader's ends of the pipes, follower rank order (rank 1 first)."""
        return [leader for leader, _ in self._pipes]

    def after_start(self) -> None:
        """Close the followers' pipe ends here once their processes hold them, so that a
        follower's death shows as end-of-file on its pipe."""
        for _, follower in self._pipes:
            follower.close()

    def attached(self) -> None:
        """Every follower has opened its end (it reported so): the shared files need no
        names any more, and none is left behind if this process is killed."""
        self._segment.unlink()
        self._progress_segment.unlink()

    def send(self, kind: CallKind, arrays: Mapping[str, np.ndarray] | None = None,
             value: int = 0, text: str = "") -> None:
        """Hand one model call to every follower."""
        with self._sending:
            self._send(kind, arrays or {}, value, text)

    def _send(self, kind: CallKind, arrays: Mapping[str, np.ndarray], value: int,
              text: str) -> None:
        layout = self._write(arrays)
        header = json.dumps((int(kind), value, self._new_path, layout, text)).encode()
        for conn in self.connections:
            conn.send_bytes(header)
        # Every follower maps a new segment before it joins this call's collective;
        # the leader sends again only after that, so the old files can go.
        if self._new_path is not None:
            self._new_path = None
            for old in self._retired:
                old.unlink()
                old.close()
            self._retired.clear()
        self._progress[0] += 1

    def _write(self, arrays: Mapping[str, np.ndarray]) -> list[tuple[str, str, tuple[int, ...],
                                                                     int]]:
        layout = []
        offset = 0
        for name, array in arrays.items():
            layout.append((name, array.dtype.str, array.shape, offset))
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        if offset > self._segment.size:
            self._retired.append(self._segment)
            self._segment = _Segment.create(max(offset, 2 * self._segment.size))
            self._new_path = self._segment.path
        buffer = self._segment.map
        for (_, dtype, shape, start), array in zip(layout, arrays.values(), strict=True):
            view = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=start)
            view[...] = array
        return layout

    def progress(self) -> list[int]:
        """Calls finished per rank (rank 0: calls sent)."""
        return self._progress[: len(self._pipes) + 1].tolist()

    def close(self) -> None:
        """Tell the followers to stop (best effort: a dead one is already gone)."""
        if self._closed:
            return
        self._closed = True
        header = json.dumps((int(CallKind.STOP), 0, None, [], "")).encode()
        for conn in self.connections:
            with contextlib.suppress(OSError):  # a dead follower's pipe
                conn.send_bytes(header)
            conn.close()
        for segment in (*self._retired, self._segment, self._progress_segment):
            segment.unlink()


def read_report(conn: Connection) -> tuple[str, Any]:
    """A follower's report (see `FollowerChannel.report`); EOFError when it is gone."""
    kind, value = json.loads(conn.recv_bytes())
    return kind, value


@dataclass
class FollowerChannel:
    """A follower's end; created by the leader and passed to the follower's process."""

    rank: int
    conn: Connection
    segment_path: str
    segment_size: int
    progress_path: str

    def open(self) -> None:
        """Map the shared memory; first thing in the follower's process."""
        self._reporting = threading.Lock()
        self._segment = _Segment(self.segment_path, self.segment_size, create=False)
        progress = _Segment(self.progress_path, 8 * _PROGRESS_SLOTS, create=False)
        self._progress = np.frombuffer(progress.map, dtype=np.int64)

    def receive(self) -> Call:
        """The leader's next call; blocks (no CPU) until it comes. Raises EOFError when
        the leader is gone."""
        kind, value, new_path, layout, text = json.loads(self.conn.recv_bytes())
        if new_path is not None and new_path != self._segment.path:
            self._segment.close()
            size = os.stat(new_path).st_size
            self._segment = _Segment(new_path, size, create=False)
        buffer = self._segment.map
        # Copied out: the leader overwrites the segment on its next call.
        arrays = {name: np.ndarray(shape, dtype=dtype, buffer=buffer, offset=start).copy()
                  for name, dtype, shape, start in layout}
        return Call(CallKind(kind), arrays, value, text)

    def done(self) -> None:
        """Count one finished call (the leader reads it to name a rank that stalls)."""
        self._progress[self.rank] += 1

    def report(self, message: tuple[str, Any]) -> None:
        """Send the leader a startup report, a weight-update step's outcome, a failed
        step it lived through, a re-forming's outcome or a failure: ("ready", num_blocks),
        ("weights", {...}), ("step_failed", text), ("reformed", error or "") or
        ("error", text). Any thread."""
        data = json.dumps(message).encode()
        # No lock before `open` (a failure that early): no other thread reports yet.
        lock = getattr(self, "_reporting", None) or contextlib.nullcontext()
        with lock, contextlib.suppress(OSError):  # the leader is gone; nothing to tell
            self.conn.send_bytes(data)
