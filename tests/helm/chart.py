"""Render the Helm chart with the pinned helm binary (`make helm`).

`python -m tests.helm.chart` (`make helm-golden`) rewrites the golden files that the
tests compare fresh renders against.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "corestream"
HELM = Path(os.environ.get("HELM", ROOT / ".tools" / "helm" / "helm"))
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
RELEASE = "corestream"
NAMESPACE = "llm"

# Golden name -> values files layered over the chart's values.yaml.
CASES: dict[str, tuple[Path, ...]] = {
    "default": (),
    "gpu-mtls-dp2": (CHART / "ci" / "gpu-mtls-dp2-values.yaml",),
    "cpu-tp2": (CHART / "ci" / "cpu-tp2-values.yaml",),
    "inference-pool": (CHART / "ci" / "inference-pool-values.yaml",),
}


class RenderError(Exception):
    """helm refused the values; the message is helm's stderr."""


def helm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "HELM_CACHE_HOME": "/tmp/corestream-helm/cache",
             "HELM_CONFIG_HOME": "/tmp/corestream-helm/config",
             "HELM_DATA_HOME": "/tmp/corestream-helm/data"},
    )


def render_text(values: Iterable[Path] = (), set_json: Iterable[str] = ()) -> str:
    """`helm template` output for the values files and `--set-json key=json` overrides."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values:
        args += ["--values", str(path)]
    for item in set_json:
        args += ["--set-json", item]
    result = helm(*args)
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())
    return result.stdout


def render(values: Iterable[Path] = (), set_json: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The rendered objects, in helm's order."""
    return [doc for doc in yaml.safe_load_all(render_text(values, set_json)) if doc]


def golden_path(case: str) -> Path:
    return GOLDEN_DIR / f"{case}.yaml"


def containers(obj: dict[str, Any], init: bool = True) -> Iterator[dict[str, Any]]:
    """Every container (and init container) of a workload object."""
    spec = pod_spec(obj)
    if spec is None:
        return
    yield from spec.get("containers", [])
    if init:
        yield from spec.get("initContainers", [])


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def write_goldens() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for case, values in CASES.items():
        golden_path(case).write_text(render_text(values), encoding="utf-8")
        print(f"wrote {golden_path(case).relative_to(ROOT)}")


if __name__ == "__main__":
    if not HELM.is_file():
        sys.exit(f"{HELM} is missing: run `make helm`")
    write_goldens()
