"""The chart's optional Gateway API Inference Extension InferencePool, checked against the
published CRD (tests/helm/crds/, GAIE v1.6.0): its openAPIV3Schema, the CEL rules the
API server would run, and that the pool's selector and port are the frontends' HTTP door.
(`helm lint --strict`, the golden render and the frontend's flags parsing with the real
CLI run for the `inference-pool` case in test_chart.py.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.common.metrics import PREFIX
from services.frontend.model_server_metrics import ServerLoad, load_families
from tests.helm.chart import CHART, RenderError, containers, render

pytestmark = [pytest.mark.usefixtures("helm_binary"), pytest.mark.timeout(120)]

CRD = Path(__file__).resolve().parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_VALUES = (CHART / "ci" / "inference-pool-values.yaml",)


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would refuse: the schema, then the CRD's CEL rules (written
    out here: endpointPickerRef needs a port for a Service, target ports are unique)."""
    validator = jsonschema.Draft7Validator(_crd_schema())
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
    spec = obj.get("spec", {})
    picker = spec.get("endpointPickerRef", {})
    if picker.get("kind", "Service") == "Service" and "port" not in picker:
        errors.append("endpointPickerRef: port is required when kind is 'Service'")
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errors.append("targetPorts: port number must be unique")
    return errors


def _pool(objs: list[dict[str, Any]]) -> dict[str, Any]:
    [pool] = [o for o in objs if o["kind"] == "InferencePool"]
    return pool


def _frontend(objs: list[dict[str, Any]]) -> dict[str, Any]:
    [deployment] = [o for o in objs if o["kind"] == "Deployment"
                    and o["metadata"]["name"].endswith("-frontend")]
    return deployment


def test_the_pool_validates_against_the_published_crd() -> None:
    pool = _pool(render(POOL_VALUES))
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert _errors(pool) == []
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "gaie-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}


@pytest.mark.parametrize("breakage", [
    lambda spec: spec.pop("targetPorts"),
    lambda spec: spec["targetPorts"].append({"number": spec["targetPorts"][0]["number"]}),
    lambda spec: spec["endpointPickerRef"].pop("port"),
    lambda spec: spec["endpointPickerRef"].update(failureMode="Sometimes"),
    lambda spec: spec.update(selector={"matchLabels": {}}),
])
def test_the_check_refuses_broken_pools(breakage: Any) -> None:
    # The validation above is not vacuous: what the API server refuses, it refuses.
    pool = copy.deepcopy(_pool(render(POOL_VALUES)))
    breakage(pool["spec"])
    assert _errors(pool)


def test_the_pool_selects_exactly_the_frontends_http_port() -> None:
    objs = render(POOL_VALUES)
    pool, frontend = _pool(objs), _frontend(objs)
    selector = pool["spec"]["selector"]["matchLabels"]
    for obj in objs:
        labels = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels")
        if labels is not None:
            selected = selector.items() <= labels.items()
            assert selected == (obj is frontend), obj["metadata"]["name"]
    [container] = [c for c in containers(frontend) if c["name"] == "frontend"]
    [http] = [p for p in container["ports"] if p["name"] == "http"]
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    assert f"--http-port={http['containerPort']}" in container["args"]
    # Pickers at their vLLM defaults read the load under vLLM's names.
    assert "--vllm-metric-names" in container["args"]


def test_vllm_names_can_be_left_to_the_pickers_configuration() -> None:
    objs = render(POOL_VALUES, ['inferencePool={"enabled": true, "vllmMetricNames": false}'])
    [container] = [c for c in containers(_frontend(objs)) if c["name"] == "frontend"]
    assert "--vllm-metric-names" not in container["args"]
    assert _pool(objs)["spec"]["endpointPickerRef"]["name"] == "corestream-epp"


def test_off_by_default() -> None:
    objs = render()
    assert not [o for o in objs if o["kind"] == "InferencePool"]
    [container] = [c for c in containers(_frontend(objs)) if c["name"] == "frontend"]
    assert "--vllm-metric-names" not in container["args"]


@pytest.mark.parametrize(("overrides", "words"), [
    (['inferencePool={"enabled": true}'], "needs frontend.http.enabled"),
    (['inferencePool={"enabled": true}', 'frontend={"http": {"enabled": true}}',
      'metrics={"enabled": false}'], "needs metrics.enabled"),
    (['inferencePool={"endpointPicker": {"failureMode": "Sometimes"}}'], "failureMode"),
    (['inferencePool={"selector": {}}'], "selector"),
])
def test_bad_values_are_refused(overrides: list[str], words: str) -> None:
    with pytest.raises(RenderError) as refused:
        render(set_json=overrides)
    assert words in str(refused.value)


# The EndpointPickerConfig fields, plugin types and core-metrics-extractor parameters of
# GAIE v1.5.0's EPP (apix/config/v1alpha1/endpointpickerconfig_types.go and the plugins'
# factories under pkg/epp/framework/plugins at tag v1.5.0; v1.6.0 no longer ships the
# EPP), written out so that a field the picker would not know fails here.
EPP_CONFIG_FIELDS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles",
                     "saturationDetector", "dataLayer", "flowControl", "parser"}
EPP_PLUGIN_TYPES = {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer",
                    "max-score-picker", "single-profile-handler", "metrics-data-source",
                    "core-metrics-extractor"}
EXTRACTOR_FIELDS = {"engineLabelKey", "defaultEngine", "engineConfigs"}
ENGINE_CONFIG_FIELDS = {"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec",
                        "loraSpec", "cacheInfoSpec", "cacheBlockSizeLabelName",
                        "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec"}


def _epp_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    [config_map] = [o for o in objs if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"].endswith("-epp-config")]
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["endpoint-picker.yaml"])
    return config


def test_the_epp_config_reads_corestreams_own_metric_names_from_the_frontends() -> None:
    objs = render(POOL_VALUES)
    config = _epp_config(objs)
    assert (config["apiVersion"], config["kind"]) == (
        "inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    assert set(config) <= EPP_CONFIG_FIELDS
    # Without the gate the EPP ignores dataLayer and scrapes vLLM's names.
    assert "dataLayer" in config["featureGates"]
    plugins = {p["type"]: p for p in config["plugins"]}
    assert set(plugins) <= EPP_PLUGIN_TYPES
    refs = {r["pluginRef"] for profile in config["schedulingProfiles"]
            for r in profile["plugins"]}
    [source] = config["dataLayer"]["sources"]
    refs |= {source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])}
    assert refs <= set(plugins)  # every reference names a plugin instance
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"

    extractor = plugins["core-metrics-extractor"]["parameters"]
    assert set(extractor) <= EXTRACTOR_FIELDS
    [engine] = extractor["engineConfigs"]
    assert set(engine) <= ENGINE_CONFIG_FIELDS
    assert engine["name"] == extractor["defaultEngine"] == "corestream"
    # The frontend pods the pool selects carry the label that picks this engine config.
    labels = _frontend(objs)["spec"]["template"]["metadata"]["labels"]
    assert labels[extractor["engineLabelKey"]] == engine["name"]
    # The names are the ones the frontend exports, labels and all.
    load = ServerLoad(num_running=1, num_waiting=2, kv_cache_usage=0.5, block_size=16,
                      num_blocks=64)
    families = {f.name: f for f in load_families(PREFIX + "server_", "m", load)}
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec",
                 "cacheInfoSpec"):
        assert engine[spec] in families, (spec, engine[spec], sorted(families))
    [sample] = families[engine["cacheInfoSpec"]].samples
    assert {"block_size", "num_gpu_blocks"} <= set(sample.labels)  # the extractor's labels
    assert engine["loraSpec"] == ""  # no adapters: nothing to scrape


def test_the_epp_config_scrapes_https_with_tls_and_can_be_left_out() -> None:
    tls = _epp_config(render(POOL_VALUES, ['security={"tls":{"enabled":true,'
                                           '"existingSecret":"certs"}}']))
    [source] = [p for p in tls["plugins"] if p["type"] == "metrics-data-source"]
    assert source["parameters"]["scheme"] == "https"
    objs = render(POOL_VALUES, ['inferencePool={"enabled":true,"endpointPicker":{"config":false}}'])
    assert not [o for o in objs if o["metadata"]["name"].endswith("-epp-config")]
