"""The README stays true: every flag it names exists where it says, and its quick start
runs as written against a real cluster and prints what the README says it prints.

Quick-start blocks are the fenced blocks after a `<!-- quickstart -->` line; the block
after a `<!-- quickstart output -->` line is what the block before it prints, abridged:
each of its lines, in order, must match a line of the output, `...` matching anything
(a line that is only `...` stands for lines left out). The README's addresses
(127.0.0.1:50051, the HTTP port of its `make serve` line) are rewritten to the test
cluster's, and `source .venv/bin/activate` to the virtualenv under test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli.main import build_parser
from tests.integration.cluster import REPO, Cluster, descendants, free_port

README = REPO / "README.md"
README_GRPC = "127.0.0.1:50051"
ACTIVATE = "source .venv/bin/activate"

# Flags of the other tools the README runs (grpcurl's and curl's are single-dash).
OTHER_TOOLS: dict[str, frozenset[str]] = {
    "helm": frozenset({"--namespace", "--create-namespace", "--set", "--set-file",
                       "--reuse-values", "--strict"}),
    "kubectl": frozenset({"--namespace"}),
    "docker": frozenset({"--build-arg"}),
    "pip": frozenset(),
}
OTHER_FLAGS = frozenset().union(*OTHER_TOOLS.values())


# --- reading the README ------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    marker: str  # "quickstart", "quickstart output" or ""


def fenced_blocks(text: str) -> list[Block]:
    found = re.finditer(r"(?:<!-- (quickstart(?: output)?) -->\n)?^```(\w*)\n(.*?)^```$",
                        text, re.DOTALL | re.MULTILINE)
    return [Block(m.group(2), m.group(3), m.group(1) or "") for m in found]


def prose(text: str) -> str:
    return re.sub(r"^```\w*\n.*?^```$", "", text, flags=re.DOTALL | re.MULTILINE)


def commands(block: str) -> Iterator[list[str]]:
    """Each simple command of a shell block, as words, comments and operators gone."""
    joined = block.replace("\\\n", " ")
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in lexer:
            if set(word) <= set("&|;()<>"):
                if command:
                    yield command
                command = []
            else:
                command.append(word)
        if command:
            yield command


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


# --- flags -------------------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def corestream_flags() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}


def known(flag: str, options: set[str]) -> bool:
    # `--tls-*` names a family of flags.
    return any(o.startswith(flag) for o in options) if flag.endswith("-") else flag in options


def script_flags(path: str) -> set[str]:
    """The flags a benchmark or helper script defines, read from its source."""
    return set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", (REPO / path).read_text()))


def unknown_flags(words: list[str], parsers: dict[str, set[str]]) -> list[str]:
    """The flags in one command that its program does not have."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # environment assignments
    if not words:
        return []
    program, args = Path(words[0]).name, words[1:]
    if program == "make":
        values = [w.removeprefix("ARGS=") for w in args if w.startswith("ARGS=")]
        return [f for v in values for f in unknown_flags(["corestream", "serve", *shlex.split(v)],
                                                         parsers)]
    flags = [w.split("=")[0] for w in args if FLAG.fullmatch(w.split("=")[0])]
    if program == "corestream":
        sub = args[0] if args else ""
        options = (parsers[sub] if sub in parsers
                   else set().union(*parsers.values()) if sub.startswith("<") else set())
        return [f"corestream {sub} {f}" for f in flags if not known(f, options)]
    if program.startswith("python"):
        script = next((w for w in args if w.endswith(".py")), "")
        if not script and "-m" in args[:-1]:
            # `python -m benchmarks.soak`: a package's __main__.py, or a module's file.
            module = args[args.index("-m") + 1].replace(".", "/")
            script = next((f for f in (f"{module}/__main__.py", f"{module}.py")
                           if (REPO / f).is_file()), "")
        options = script_flags(script) if (REPO / script).is_file() else set()
        return [f"{script} {f}" for f in flags if f not in options]
    if program in OTHER_TOOLS:
        return [f"{program} {f}" for f in flags if f not in OTHER_TOOLS[program]]
    return [f"{program} {f} (a tool the test does not know: add it to OTHER_TOOLS)"
            for f in flags]


def test_every_flag_the_readme_names_exists() -> None:
    text = README.read_text()
    parsers = corestream_flags()
    bad = [f for block in fenced_blocks(text) if block.lang in ("bash", "sh")
           for words in commands(block.body) for f in unknown_flags(words, parsers)]
    # Inline code: a command (`corestream serve --tls-auto`, `make serve ARGS=...`) is
    # checked as one; a lone flag must be corestream's, a benchmark script's or another
    # tool's the README runs.
    anywhere = set().union(*parsers.values()) | OTHER_FLAGS
    anywhere |= {f for path in REPO.glob("benchmarks/**/*.py")
                 for f in script_flags(str(path.relative_to(REPO)))}
    spans = re.findall(r"`([^`]+)`", prose(text))
    spans += FLAG.findall(re.sub(r"`[^`]+`", "", prose(text)))  # flags outside code too
    assert len(spans) > 500, "the README's inline code was not found"
    for span in spans:
        span = " ".join(span.split())
        if re.match(rf"([A-Z_]+=\S* )*(\S*/)?(corestream|make|python\S*|{'|'.join(OTHER_TOOLS)}) ",
                    span):
            bad += [f for words in commands(span) for f in unknown_flags(words, parsers)]
        else:
            bad += [f"`{span}`: {f}" for f in FLAG.findall(span) if not known(f, anywhere)]
    assert not bad, "flags the README names that do not exist:\n" + "\n".join(bad)


def test_the_flag_check_catches_a_wrong_flag() -> None:
    parsers = corestream_flags()
    assert unknown_flags(["corestream", "serve", "--http-port", "8000"], parsers) == []
    assert unknown_flags(["corestream", "admin", "--http-port", "8000"], parsers)
    assert unknown_flags(["make", "serve", "ARGS=--engines 2 --no-such-flag"], parsers)
    assert unknown_flags(["corestream", "serve", "--tls-"], parsers) == []
    assert unknown_flags([".venv/bin/python", "benchmarks/latency.py", "--shapes"], parsers) == []
    assert unknown_flags(["python", "benchmarks/latency.py", "--single"], parsers)


# --- the quick start ---------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    lang: str
    code: str
    prints: str  # the README's abridged output, '' when it shows none


def quick_start(text: str) -> tuple[list[str], list[Step]]:
    """The `make serve` flags of the quick start, and its marked blocks in order."""
    serve = [w for block in fenced_blocks(section(text, "Quick start"))
             for words in commands(block.body) if words[:2] == ["make", "serve"]
             for w in words if w.startswith("ARGS=")]
    assert len(serve) == 1, "the quick start should start the cluster with one `make serve`"
    blocks = fenced_blocks(text)
    steps = [Step(b.lang, b.body,
                  blocks[i + 1].body if i + 1 < len(blocks)
                  and blocks[i + 1].marker == "quickstart output" else "")
             for i, b in enumerate(blocks) if b.marker == "quickstart"]
    return shlex.split(serve[0].removeprefix("ARGS=")), steps


def assert_prints(expected: str, output: str) -> None:
    lines = [line.strip() for line in output.splitlines()]
    at = 0
    for want in expected.splitlines():
        want = want.strip()
        if not want or want == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")))
        at = next((i + 1 for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), -1)
        assert at > 0, f"the output has no line {want!r} (in order):\n{output}"


def http_port(serve_args: Sequence[str]) -> str:
    return serve_args[list(serve_args).index("--http-port") + 1]


def with_http_port(serve_args: Sequence[str], port: int) -> list[str]:
    args = list(serve_args)
    args[args.index("--http-port") + 1] = str(port)
    return args


def run_quick_start(steps: list[Step], venv_bin: Path, python: Path, grpc_address: str,
                    readme_http: str, http: int, cwd: Path) -> None:
    """Each step as the reader runs it, in one shell that keeps its `source` and `export`
    lines, with the README's addresses rewritten to the cluster's."""
    activate = venv_bin / "activate"
    rewrites = [
        (ACTIVATE, f"source {activate}" if activate.exists()
         else f'export PATH="{venv_bin}:$PATH"'),
        (README_GRPC, grpc_address),
        (f"127.0.0.1:{readme_http}", f"127.0.0.1:{http}"),
    ]
    state: list[str] = []
    clients: set[str] = set()
    for step in steps:
        code = step.code
        for old, new in rewrites:
            code = code.replace(old, new)
        if step.lang == "bash":
            argv, stdin = ["bash", "-euo", "pipefail", "-c", "\n".join([*state, code])], None
            state += [line for line in code.splitlines() if line.startswith(("source ", "export "))]
            clients |= {words[0] for words in commands(code)}
        else:
            assert step.lang == "python", step.lang
            argv, stdin = [str(python), "-"], code
            if "from openai import" in code:
                clients.add("openai")
        done = subprocess.run(argv, input=stdin, cwd=cwd, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, (
            f"{step.code}\nexited {done.returncode}:\n{done.stdout}{done.stderr}")
        assert_prints(step.prints, done.stdout)
    # A first request by each of the three.
    assert {"grpcurl", "curl", "openai"} <= clients, clients


@pytest.mark.timeout(600)
def test_the_quick_start_runs_as_written() -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    serve_args, steps = quick_start(README.read_text())
    http = free_port()
    cluster = Cluster(with_http_port(serve_args, http))
    try:
        run_quick_start(steps, Path(sys.executable).parent, Path(sys.executable),
                        cluster.address, http_port(serve_args), http, REPO)
    finally:
        cluster.stop()


def test_the_output_check_is_strict() -> None:
    assert_prints('{\n  "model": "tiny-...",\n  ...\n  "num_engines": 1\n}',
                  '{\n  "model": "tiny-llama-v2",\n  "dtype": "float32",\n  "num_engines": 1\n}')
    with pytest.raises(AssertionError):
        assert_prints('"num_engines": 2', '"num_engines": 1')
    with pytest.raises(AssertionError):
        assert_prints('"b": 1\n"a": 1', '"a": 1\n"b": 1')


# --- the quick start in a fresh clone ----------------------------------------------------

@contextlib.contextmanager
def serving(corestream: Path, args: Sequence[str], cwd: Path,
            timeout: float = 900) -> Iterator[float]:
    """`corestream serve ARGS` until the block ends; yields the seconds it took to print
    that it is serving."""
    start = time.monotonic()
    proc = subprocess.Popen([str(corestream), "serve", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "corestream is serving on" in line:
                break
            assert time.monotonic() - start < timeout, "".join(lines[-100:])
        else:
            raise AssertionError("serve exited before serving:\n" + "".join(lines[-100:]))
        yield time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_quick_start_in_a_fresh_clone(tmp_path: Path) -> None:
    """What a new user does: clone, `make serve`'s install step (a fresh virtualenv, from
    the package index: minutes), serve, then the quick start with that virtualenv's
    commands. The CPU kernels are cached per machine, so serve should take seconds."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    clone = tmp_path / "corestream"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    started = time.monotonic()
    subprocess.run(["make", ".venv/.serve-installed"], cwd=clone, check=True, timeout=3000)
    installed = time.monotonic() - started
    venv_bin = clone / ".venv" / "bin"
    serve_args, steps = quick_start((clone / "README.md").read_text())
    port, http = free_port(), free_port()
    args = ["--port", str(port), "--metrics-port", "0", *with_http_port(serve_args, http)]
    with serving(venv_bin / "corestream", args, clone) as seconds:
        print(f"install {installed:.0f} s; corestream serve to serving: {seconds:.1f} s")
        run_quick_start(steps, venv_bin, venv_bin / "python", f"127.0.0.1:{port}",
                        http_port(serve_args), http, clone)
