"""free_port: ports below the kernel's ephemeral range, never promised twice on one host
within the ledger's window, and still a port when the ledger cannot be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import ports

ROOT = Path(__file__).parents[3]


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    return tmp_path


def test_ports_come_from_below_the_ephemeral_range_and_are_recorded(ledger_dir: Path) -> None:
    low, _ = ports._ephemeral_range()
    if low - ports._LOWEST < 4096:
        pytest.skip(f"ephemeral range starts at {low}: no room below it")
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(ports._LOWEST <= p < low for p in got), got
    ledger = json.loads((ledger_dir / f"corestream-ports-{os.getuid()}.json").read_text())
    assert {int(p) for p in ledger} == set(got)


def test_two_processes_drawing_at_once_never_share_a_port(ledger_dir: Path) -> None:
    code = "from services.common.ports import free_port\nprint([free_port() for _ in range(300)])"
    env = {**os.environ, "TMPDIR": str(ledger_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE) for _ in range(2)]
    drawn = [eval(p.communicate(timeout=120)[0]) for p in procs]  # noqa: S307 (our own output)
    assert all(len(set(d)) == 300 for d in drawn)
    assert not set(drawn[0]) & set(drawn[1])


def test_a_torn_or_unwritable_ledger_still_gives_a_bindable_port(ledger_dir: Path) -> None:
    path = ledger_dir / f"corestream-ports-{os.getuid()}.json"
    path.write_text('{"123')
    port = ports.free_port()
    assert ports._bindable("127.0.0.1", port)
    assert str(port) in json.loads(path.read_text())  # the torn file is written afresh
    path.unlink()
    ledger_dir.chmod(0o500)
    try:
        assert ports._bindable("127.0.0.1", ports.free_port())
    finally:
        ledger_dir.chmod(0o700)


def test_a_block_of_consecutive_ports_is_free_and_promised_whole(ledger_dir: Path) -> None:
    # A group whose rank r listens on port + r (expert-parallel TP ranks, KV event
    # publishers): every port of the block must be free and kept from other draws.
    low, _ = ports._ephemeral_range()
    if low - ports._LOWEST < 4096:
        pytest.skip(f"ephemeral range starts at {low}: no room below it")
    first = ports.free_port(count=4)
    block = set(range(first, first + 4))
    assert all(ports._bindable("127.0.0.1", p) for p in block)
    assert first + 3 < low
    ledger = json.loads((ledger_dir / f"corestream-ports-{os.getuid()}.json").read_text())
    assert block <= {int(p) for p in ledger}
    assert not block & {ports.free_port() for _ in range(200)}
