"""The design's dependency direction, checked on the sources and by importing.

frontend and coordinator import common and the generated code, never torch; engine
imports common and kernels; kernels import only torch and triton; common imports no
service and no torch, so the frontend and coordinator images stay torch-free.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"services", "kernels", "corestream", "benchmarks", "tests"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def violations(
    folder: str, allowed_first_party: tuple[str, ...], banned: tuple[str, ...]
) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in banned or (
                top in FIRST_PARTY and not module.startswith(allowed_first_party)
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    return bad


@pytest.mark.parametrize(
    ("folder", "allowed", "banned"),
    [
        ("services/common", ("services.common", "corestream"), ("torch", "transformers")),
        ("services/frontend", ("services.common", "services.frontend", "corestream"),
         ("torch", "transformers", "triton")),
        ("services/coordinator", ("services.common", "services.coordinator", "corestream"),
         ("torch", "transformers", "triton")),
        ("services/engine", ("services.common", "services.engine", "kernels", "corestream"),
         ("transformers",)),
        ("kernels", ("kernels",), ("transformers",)),
    ],
)
def test_dependency_direction(
    folder: str, allowed: tuple[str, ...], banned: tuple[str, ...]
) -> None:
    assert violations(folder, allowed, banned) == []


def test_torch_free_services_import_without_torch() -> None:
    # A finder that makes torch unimportable, as in the frontend and coordinator images.
    code = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton"):
            raise ImportError(f"{name} is not installed in this image")
sys.meta_path.insert(0, NoTorch())
import services.frontend.main, services.frontend.server, services.coordinator.main
import services.cli
services.cli.build_parser().parse_args(["frontend"])
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
