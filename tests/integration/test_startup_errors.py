"""`corestream serve` ends at once on startup errors that no restart can cure: one line
naming the cause, exit code 2, no traceback, no restart. Crashes alone are restarted
(test_serve_healing.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from services.common.tiny_checkpoint import resolve_model
from tests.integration.cluster import REPO, free_port

pytestmark = pytest.mark.timeout(120)


def serve(args: Sequence[str], env: dict[str, str] | None = None,
          timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--metrics-port", "0", *args],
        cwd=REPO, text=True,
        capture_output=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The error serve printed: exactly one line, no traceback, exit code 2, and no
    process started (serve checks before it starts any: under a second here, where the
    crash loop it replaced took 37 s)."""
    output = done.stdout + done.stderr
    assert "starting" not in output, output
    assert done.returncode == 2, output
    assert "Traceback" not in output, output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("corestream serve: "), output
    return lines[0]


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_busy_port_is_named_with_its_holder(listener: int) -> None:
    line = one_line_error(serve(["--port", str(listener)]))
    assert f"port {listener} is in use by pid {os.getpid()}" in line
    assert line.endswith("pass --port")


def test_a_busy_http_port_is_named(listener: int) -> None:
    line = one_line_error(serve(["--port", str(free_port()), "--http-port", str(listener)]))
    assert f"port {listener} is in use" in line and line.endswith("pass --http-port")


def test_a_hub_id_not_on_this_machine(tmp_path: Path) -> None:
    line = one_line_error(serve(["--model", "Qwen/Qwen2.5-0.5B-Instruct"],
                                env={"HF_HOME": str(tmp_path), "HF_HUB_CACHE": ""}))
    assert "reads local checkpoints only" in line
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in line


def test_a_path_that_is_no_checkpoint(tmp_path: Path) -> None:
    line = one_line_error(serve(["--model", str(tmp_path / "missing")]))
    assert "no such folder" in line
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    line = one_line_error(serve(["--model", str(tmp_path)]))
    assert "names no `architectures`" in line


def test_an_unknown_architecture_is_refused_before_any_engine_starts(tmp_path: Path) -> None:
    checkpoint = tmp_path / "gpt2"
    shutil.copytree(resolve_model(None), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    done = serve(["--model", str(checkpoint), "--port", str(free_port())])
    line = one_line_error(done)
    assert "no supported architecture among ['GPT2LMHeadModel']" in line
    assert "LlamaForCausalLM" in line  # what is supported


def test_an_engine_that_refuses_the_checkpoint_stops_serve_without_restarts(
    tmp_path: Path,
) -> None:
    # Found by the engine alone, as it builds the model (serve is torch-free): it exits 2
    # with its reason, and serve stops the cluster at once instead of restarting it.
    checkpoint = tmp_path / "odd-rope"
    shutil.copytree(resolve_model(None), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(
        json.dumps({**config, "rope_scaling": {"rope_type": "weird", "factor": 2.0}}))
    done = serve(["--model", str(checkpoint), "--port", str(free_port())])
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output, output
    assert "rope_type 'weird' is not supported" in output
    assert "engine-0 cannot start with these flags or this checkpoint" in output
    assert output.count("starting engine-0") == 1, output
    # The frontend, started beside the engine, logs its argv and config, which name
    # serve's restart status file.
    said = re.sub(r"--restart-status-file \S+|restart_status_file='[^']*'", "", output)
    assert "restart" not in said.replace("no restart would cure", ""), output


def test_a_killed_serves_temp_folder_is_removed_by_the_next(listener: int,
                                                           tmp_path: Path) -> None:
    # A folder named after a pid that no longer runs, as a SIGKILLed serve leaves it.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"corestream-serve-{gone.stdout.strip()}-x1"
    mine = tmp_path / f"corestream-serve-{os.getpid()}-x2"
    stale.mkdir()
    mine.mkdir()
    # The next serve, even one that fails, removes the dead one's folder and its own.
    one_line_error(serve(["--port", str(listener)], env={"TMPDIR": str(tmp_path)}))
    # (The ports ledger stays: it is shared by every process of the user, not serve's.)
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("corestream-ports-"))
    assert left == [mine.name]


def test_int8_quantization_of_a_gguf_file_is_refused(smollm2_gguf: Path) -> None:
    line = one_line_error(serve(["--model", str(smollm2_gguf), "--quantization", "int8",
                                 "--port", str(free_port())]))
    assert "is a GGUF file, served with its own quantization: drop --quantization" in line


@pytest.mark.parametrize("case", ["kv-cache", "draft-vocabulary"])
def test_a_flag_error_found_as_the_engine_loads_ends_serve_at_the_first_start(
        tmp_path: Path, case: str) -> None:
    # Found after (or while) the model loads: the engine must still exit 2 with its one
    # line, not abort on a thread still copying weights (which serve would restart).
    if case == "kv-cache":
        args, reason = ["--kv-cache-memory", "1KiB"], "kv_cache_memory '1KiB'"
    else:
        draft = tmp_path / "draft"
        shutil.copytree(resolve_model(None), draft)
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))
        args = ["--speculative-config", json.dumps({
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})]
        reason = "the draft model draft has a vocabulary of 500 tokens"
    done = serve([*args, "--port", str(free_port())])
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert reason in output, output
    assert "SIGABRT" not in output and "terminate called" not in output, output
    assert output.count("starting engine-0") == 1, output
