"""StepChannel: a leader's calls reach a follower process intact, in order, also when
a batch outgrows the shared segment, and the follower sees the leader go."""

from __future__ import annotations

import glob
import hashlib
import multiprocessing

import numpy as np
import pytest

from services.engine.executor.step_channel import (
    CallKind,
    FollowerChannel,
    LeaderChannel,
    read_report,
)


def _echo(channel: FollowerChannel) -> None:
    """Follower: reports each call's kind, value and arrays back, until STOP or EOF."""
    channel.open()
    channel.report(("open", None))
    while True:
        try:
            call = channel.receive()
        except EOFError:
            channel.report(("eof", None))
            return
        digests = {name: [a.dtype.str, list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
                   for name, a in call.arrays.items()}
        # Counted before the report: once the leader reads it, the count must show.
        channel.done()
        channel.report((call.kind.name, [call.value, digests]))
        if call.kind is CallKind.STOP:
            return


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/corestream-tp-*"))


@pytest.mark.timeout(60)
def test_calls_arrive_intact_in_order_through_a_growing_segment() -> None:
    before = _segments()
    leader = LeaderChannel(num_followers=1)
    process = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(leader.follower_end(1),))
    process.start()
    leader.after_start()
    (conn,) = leader.connections
    assert conn.poll(30) and read_report(conn) == ("open", None)
    leader.attached()
    try:
        rng = np.random.default_rng(0)
        for size in (3, 1000, 300_000, 10):  # 300k int64 rows outgrow the 1 MiB segment
            arrays = {"ids": rng.integers(0, 1 << 40, size), "tables": rng.integers(
                0, 1000, (size % 7 + 1, 5)).astype(np.int32), "empty": np.zeros(0, np.int64)}
            leader.send(CallKind.FORWARD, arrays, value=size)
            assert conn.poll(30)
            kind, (value, received) = read_report(conn)
            assert (kind, value) == ("FORWARD", size)
            assert received == {
                name: [a.dtype.str, list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
                for name, a in arrays.items()}
        assert leader.progress() == [4, 4]
        leader.close()
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
    assert _segments() == before, "the leader left shared-memory files behind"


@pytest.mark.timeout(60)
def test_a_follower_sees_end_of_file_when_the_leader_goes() -> None:
    leader = LeaderChannel(num_followers=1)
    child_end = leader.follower_end(1)
    process = multiprocessing.get_context("spawn").Process(target=_echo, args=(child_end,))
    process.start()
    leader.after_start()
    (conn,) = leader.connections
    assert conn.poll(30) and read_report(conn) == ("open", None)
    # A leader that dies closes its pipe ends without a STOP.
    conn.close()
    process.join(30)
    assert process.exitcode == 0  # it returned on EOFError: no STOP was sent
    leader.close()
