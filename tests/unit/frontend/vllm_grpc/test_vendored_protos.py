"""The services speak vLLM's API through the vendored protos only: the smg-grpc-proto
package registers the same protobuf names, and one process cannot hold both."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def importers_of(package: str, folder: str) -> set[str]:
    """The files under `folder` that import `package` (lazy imports included)."""
    found = set()
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == package for name in names):
                found.add(str(path.relative_to(ROOT)))
    return found


def test_no_service_imports_the_smg_package() -> None:
    assert importers_of("smg_grpc_proto", "services") == set()


def test_only_the_integration_client_imports_it() -> None:
    assert importers_of("smg_grpc_proto", "tests") == {"tests/integration/vllm_grpc_client.py"}
