"""Bad values are refused at install time, by values.schema.json or by a template rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helm.chart import RenderError, containers, render, render_text

pytestmark = [pytest.mark.usefixtures("helm_binary"), pytest.mark.timeout(120)]

SCHEMA_ERROR = "values don't meet the specifications of the schema"


def refused(*overrides: tuple[str, object]) -> str:
    with pytest.raises(RenderError) as info:
        render_text(set_json=[f"{key}={json.dumps(value)}" for key, value in overrides])
    return str(info.value)


@pytest.mark.parametrize(("key", "value", "where"), [
    ("parallelism.dataParallelSize", "two", "/parallelism/dataParallelSize"),
    ("parallelism.dataParallelSize", 0, "/parallelism/dataParallelSize"),
    ("frontend.replicas", 1.5, "/frontend/replicas"),
    ("frontend.replica", 2, "/frontend"),
    ("engine.dtype", "fp8", "/engine/dtype"),
    ("engine.accelerator.count", "1", "/engine/accelerator/count"),
    ("engine.kvCacheMemory", "lots", "/engine/kvCacheMemory"),
    ("metrics.port", 70000, "/metrics/port"),
    ("logLevel", "verbose", "/logLevel"),
    ("tracing.sampleRatio", 2, "/tracing/sampleRatio"),
    ("tracing.otlpEndpoint", "collector", "/tracing/otlpEndpoint"),
    ("image.pullPolicy", "Sometimes", "/image/pullPolicy"),
    ("image.digest", "latest", "/image/digest"),
    ("termination.preStopSleepSeconds", 0, "/termination/preStopSleepSeconds"),
    ("engine.probes.startup.periodSeconds", "10s", "/engine/probes/startup/periodSeconds"),
    ("networkPolicy.enabled", "yes", "/networkPolicy/enabled"),
    ("model.path", "/abs", "/model/path"),
    ("frontend.http.port", 0, "/frontend/http/port"),
    ("frontend.http.enabled", "yes", "/frontend/http/enabled"),
    ("frontend.service.httpPort", 70000, "/frontend/service/httpPort"),
    ("parallelism.tensorParallelSize", 0, "/parallelism/tensorParallelSize"),
    ("parallelism.tensorParallelSize", 65, "/parallelism/tensorParallelSize"),
    ("parallelism.tensorParallelSize", "2", "/parallelism/tensorParallelSize"),
    ("engine.cpusPerRank", -1, "/engine/cpusPerRank"),
    ("engine.cpusPerRank", 1.5, "/engine/cpusPerRank"),
    ("engine.cpusPerRank", "4", "/engine/cpusPerRank"),
    ("frontend.chatTemplate.key", "../t.jinja", "/frontend/chatTemplate/key"),
    ("frontend.chatTemplate.template", ["{{ x }}"], "/frontend/chatTemplate/template"),
])
def test_schema_rejects_wrong_values(key: str, value: object, where: str) -> None:
    message = refused((key, value))
    assert SCHEMA_ERROR in message
    assert f"'{where}'" in message, message


@pytest.mark.parametrize(("overrides", "expected"), [
    # preStop 10 + drain 40 + 5 = 55.
    ({"termination.gracePeriodSeconds": 54},
     "frontend: termination.gracePeriodSeconds=54 is shorter than preStopSleepSeconds (10) "
     "+ drainTimeoutSeconds (40) + 5 s = 55"),
    ({"engine.termination": {"drainTimeoutSeconds": 100}},
     "engine: termination.gracePeriodSeconds=60 is shorter than preStopSleepSeconds (10) "
     "+ drainTimeoutSeconds (100) + 5 s = 115"),
    ({"coordinator.termination": {"gracePeriodSeconds": 14}},
     "coordinator: termination.gracePeriodSeconds=14 is shorter than preStopSleepSeconds (10) "
     "+ drainTimeoutSeconds (0) + 5 s = 15"),
    ({"engine.accelerator.count": 2},
     "engine.accelerator.count=2 must equal parallelism.tensorParallelSize=1"),
    ({"parallelism.tensorParallelSize": 2, "engine.accelerator.count": 1},
     "engine.accelerator.count=1 must equal parallelism.tensorParallelSize=2"),
    ({"engine.resources": {"requests": {"cpu": "4"}}},
     "engine.cpusPerRank=2 and engine.resources.requests.cpu=4 both set the engine's CPUs"),
    ({"engine.cpusPerRank": 1, "engine.resources": {"limits": {"cpu": "500m"}}},
     "engine.cpusPerRank=1 and engine.resources.limits.cpu=500m both set the engine's CPUs"),
    ({"model.path": "llama"}, "model.revision is required with model.path"),
    ({"model.path": "a/../../etc", "model.revision": "main"},
     'model.path="a/../../etc" must stay inside the model volume'),
    ({"model.download.enabled": True}, "model.download.enabled needs model.path"),
    ({"security.tls.enabled": True}, "security.tls.enabled needs security.tls.existingSecret"),
    ({"tracing.enabled": True}, "tracing.enabled needs tracing.otlpEndpoint"),
    ({"metrics.enabled": False, "metrics.serviceMonitor.enabled": True},
     "metrics.serviceMonitor.enabled needs metrics.enabled"),
    ({"metrics.port": 50061}, "engine.port and metrics.port are both 50061"),
    ({"security.tls.enabled": True, "security.tls.existingSecret": "s",
      "security.healthPort": 9090},
     "metrics.port and security.healthPort are both 9090"),
    ({"frontend.http.enabled": True, "frontend.http.port": 50051},
     "frontend.http.port and frontend.port are both 50051"),
    ({"frontend.http.enabled": True, "frontend.http.port": 9090},
     "frontend.http.port and metrics.port are both 9090"),
    ({"frontend.chatTemplate": {"template": "{{ x }}", "existingConfigMap": "mine"}},
     "frontend.chatTemplate: give the template inline (template) or in a ConfigMap of yours"),
])
def test_template_rules_fail_with_a_clear_message(
        overrides: dict[str, object], expected: str) -> None:
    message = refused(*overrides.items())
    assert expected in message, message


@pytest.mark.parametrize("overrides", [
    {"termination.gracePeriodSeconds": 55},
    {"engine.termination": {"gracePeriodSeconds": 400, "drainTimeoutSeconds": 385}},
    {"engine.accelerator.count": 1, "parallelism.dataParallelSize": 4},
    {"engine.accelerator.count": 8, "parallelism.tensorParallelSize": 8},
    {"parallelism.tensorParallelSize": 64, "engine.cpusPerRank": 1},
    {"engine.cpusPerRank": 0, "engine.resources": {"requests": {"cpu": "500m"},
                                                   "limits": {"cpu": "1"}}},
    {"networkPolicy.enabled": False, "podDisruptionBudget.enabled": False,
     "serviceAccount.create": False, "metrics.enabled": False, "bindPodIP": False},
])
def test_values_at_the_limits_render(overrides: dict[str, object]) -> None:
    assert render(set_json=[f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def test_large_integers_from_a_values_file_stay_integers(tmp_path: Path) -> None:
    # Helm reads numbers in values files as float64, which text/template prints as 1e+06;
    # argparse's int() would refuse that.
    values = tmp_path / "big.yaml"
    values.write_text("engine:\n  maxModelLen: 1048576\n  maxNumSeqs: 1000000\n"
                      "frontend:\n  maxPromptTokens: 2000000\n", encoding="utf-8")
    args = [a for o in render([values]) for c in containers(o) for a in c.get("args", [])]
    assert "--max-model-len=1048576" in args
    assert "--max-num-seqs=1000000" in args
    assert "--max-prompt-tokens=2000000" in args


def test_an_existing_claim_is_mounted_not_created() -> None:
    objs = render(set_json=['modelCache.existingClaim="models"', 'model.path="m/llama"',
                            'model.revision="v1"'])
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    claims = {v["persistentVolumeClaim"]["claimName"] for o in objs if o["kind"] in (
        "Deployment", "StatefulSet") for v in o["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v}
    assert claims == {"models"}
    args = [a for o in objs for c in containers(o) for a in c.get("args", [])]
    assert args.count("--model=/models/m/llama") == 2  # frontend and engine
