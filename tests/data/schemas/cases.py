"""The JSON Schema corpus as test cases: each schema of this folder (and the
Kubernetes-like manifest built in kubernetes_like.py) with the verdict it must get,
in the default mode and with strict_json_schema, and valid and invalid examples.
Read by the unit tests (tests/unit/common/test_schema_constraints.py) and the
integration tests (tests/integration/test_structured_output.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.data.schemas.kubernetes_like import manifest_schema

CORPUS = Path(__file__).parent


@dataclass(frozen=True)
class Case:
    name: str
    verdict: str
    """exact, approximated or refused (in the default mode)."""
    strict: str
    """accepted or refused (with strict_json_schema)."""
    schema: Any
    relaxed: tuple[str, ...] = ()
    refusal: str = ""
    valid: tuple[Any, ...] = ()
    invalid: tuple[Any, ...] = ()


def kubernetes_case() -> Case:
    schema = manifest_schema()
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
                  "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": {
                      "metadata": {"labels": {"app": "web"}},
                      "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]}}}}
    surge = json.loads(json.dumps(deployment))
    surge["spec"]["strategy"] = {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 1}}
    null_surge = json.loads(json.dumps(deployment))
    # null is both a nullable string and a nullable integer: oneOf fails.
    null_surge["spec"]["strategy"] = {"rollingUpdate": {"maxSurge": None}}
    no_spec = {k: v for k, v in deployment.items() if k != "spec"}
    return Case("kubernetes_like", "approximated", "refused", schema,
                relaxed=("/$defs/IntOrString/oneOf", "/$defs/Quantity/oneOf"),
                valid=(deployment, surge), invalid=(null_surge, no_spec))


def corpus() -> Iterator[Case]:
    for path in sorted(CORPUS.glob("*.json")):
        data = json.loads(path.read_text())
        yield Case(path.stem, data["verdict"], data["strict"], data["schema"],
                   tuple(data.get("relaxed", ())), data.get("refusal", ""),
                   tuple(data.get("valid", ())), tuple(data.get("invalid", ())))
    yield kubernetes_case()


CASES = list(corpus())
