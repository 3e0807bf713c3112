"""The services speak vLLM's API through the vendored protos only: the smg-grpc-proto
package registers the same protobuf names, and one process cannot hold both."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_dependencies import ROOT, imported_modules


def test_no_service_imports_the_smg_package() -> None:
    offenders = [str(path.relative_to(ROOT)) for path in sorted(Path(ROOT, "services").rglob(
        "*.py")) if any(m.split(".")[0] == "smg_grpc_proto" for m in imported_modules(path))]
    assert offenders == []


def test_only_the_integration_client_imports_it() -> None:
    users = {str(path.relative_to(ROOT)) for path in sorted(Path(ROOT, "tests").rglob("*.py"))
             if any(m.split(".")[0] == "smg_grpc_proto" for m in imported_modules(path))}
    assert users == {"tests/integration/vllm_grpc_client.py"}
