"""The design's dependency direction, checked on the sources and by importing.

Layers, lowest first: kernels and common; engine, coordinator and frontend; serve and
cli. A module imports its own layer's package or lower ones, never a higher layer and
never a peer service: frontend and coordinator import common and the generated code,
never torch; engine imports common and kernels; kernels import only torch and triton;
common imports no service and no torch, so the frontend and coordinator images stay
torch-free; serve and cli import the services' configs (cli also serve). And no module
of services/ sits on an import circle, counting imports under TYPE_CHECKING and inside
functions, so that the layout keeps one direction inside each package too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"services", "corestream_kernels", "corestream", "benchmarks", "tests"}


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
        ("services/engine", ("services.common", "services.engine", "corestream_kernels",
                             "corestream"),
         ("transformers",)),
        ("kernels", ("corestream_kernels",), ("transformers",)),
        ("services/serve", ("services.common", "services.serve", "services.engine.config",
                            "services.engine.waves.config", "services.engine.worker.config",
                            "services.engine.kv_publisher.config",
                            "services.engine.models.registry",
                            "services.engine.worker.cpu_threads", "services.coordinator.config",
                            "services.frontend.config", "corestream"),
         ("torch", "transformers", "triton")),
        ("services/cli", ("services.common", "services.cli", "services.serve",
                          "corestream_kernels.cpu_isa",
                          "services.engine.config", "services.engine.waves.config",
                          "services.engine.worker.config", "services.engine.kv_publisher.config",
                          "services.coordinator.config",
                          "services.frontend.config", "services.engine.main",
                          "services.frontend.main", "services.coordinator.main", "corestream"),
         ("transformers",)),
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
import services.cli.main
services.cli.main.build_parser().parse_args(["frontend"])
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_no_package_of_ours_shadows_hugging_faces_kernels() -> None:
    # transformers >= 5.25 imports Hugging Face's `kernels`. The repository's root comes
    # first on sys.path (tests, scripts), so a regular package of ours named `kernels`
    # would be found instead of theirs; the folder holds corestream_kernels instead.
    code = """
import importlib.util, json, sys
spec = importlib.util.find_spec("kernels")
where = list(spec.submodule_search_locations or []) if spec else []
print(json.dumps({"origin": spec and spec.origin, "where": where}))
"""
    done = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT,
                          capture_output=True, text=True)
    found = json.loads(done.stdout)
    if found["origin"] not in (None, "namespace"):  # a regular package: must be theirs
        assert not found["origin"].startswith(str(ROOT / "kernels")), found
    assert not (ROOT / "kernels" / "__init__.py").exists()
    import corestream_kernels

    assert Path(corestream_kernels.__file__).parent == ROOT / "kernels" / "corestream_kernels"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Edges between the modules of `package` under `root`: every import at any depth
    (under TYPE_CHECKING and inside functions too), relative ones resolved, and
    `from a import b` counted as an import of module a.b where that is a module."""
    paths = {module_name(root, p): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                           for alias in node.names]
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative so that a deep graph cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycles_in_services() -> None:
    found = cycles(import_graph(ROOT, "services"))
    assert found == [], "modules that import each other, directly or around a circle: " + (
        "; ".join(" <-> ".join(cycle) for cycle in found))


def test_cycle_check_finds_a_circle(tmp_path: Path) -> None:
    # The check itself can fail: a circle through a relative import, a TYPE_CHECKING
    # import and a lazy one, beside a module outside the circle.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n")
    (package / "c.py").write_text("def f():\n    import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_test_module_imports_another() -> None:
    # Shared fakes and helpers live in modules of their own (fakes.py, conftest.py), so
    # that moving or deleting one test file never breaks another.
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for module in imported_modules(path):
            if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_"):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith(
                    "test_"):
                bad.append(f"{path.relative_to(ROOT)} imports .{node.module}")
    assert bad == []
