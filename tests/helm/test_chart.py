"""The chart: lint, Kubernetes schema validation, goldens, probes, security, wiring."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from services.cli.main import SERVICES, build_parser
from services.common.config import from_args
from services.common.grpc_server import PROBE_SERVICE_NAMES
from tests.helm.chart import (
    CASES,
    CHART,
    NAMESPACE,
    RELEASE,
    containers,
    golden_path,
    helm,
    pod_spec,
    render,
    render_text,
)

pytestmark = [pytest.mark.usefixtures("helm_binary"), pytest.mark.timeout(120)]

# The chart's kubeVersion floor and the Kubernetes release the pinned helm was built for.
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
# Custom resources: the API schemas do not know them (checked in test_servicemonitor and
# test_inference_pool).
CRD_GROUPS = ("monitoring.coreos.com/", "inference.networking.k8s.io/")
WORKLOADS = ("Deployment", "StatefulSet", "Job")
SERVICE_CONTAINERS = ("frontend", "coordinator", "engine")


def by_kind(objs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def service_containers(objs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [c for o in objs for c in containers(o, init=False) if c["name"] in SERVICE_CONTAINERS]


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_lint_strict(case: str) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for path in CASES[case]:
        args += ["--values", str(path)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_is_valid_kubernetes(rendered: Any, case: str, version: str) -> None:
    checked = 0
    for obj in rendered(case):
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} "
                        f"at {'.'.join(map(str, exc.path))}")
        checked += 1
    assert checked >= 14


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_golden(case: str) -> None:
    golden = golden_path(case)
    assert golden.is_file(), f"{golden} is missing: run `make helm-golden`"
    assert render_text(CASES[case]) == golden.read_text(encoding="utf-8"), (
        f"the chart renders differently from {golden.name}; review the change and run "
        "`make helm-golden`")


def test_default_release_objects(rendered: Any) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered("default"))
    name = f"{RELEASE}"
    assert kinds == sorted([
        ("ServiceAccount", name),
        ("Service", f"{name}-frontend"), ("Service", f"{name}-coordinator"),
        ("Service", f"{name}-engine"),
        ("Deployment", f"{name}-frontend"), ("Deployment", f"{name}-coordinator"),
        ("StatefulSet", f"{name}-engine"),
        ("PodDisruptionBudget", f"{name}-frontend"),
        ("PodDisruptionBudget", f"{name}-coordinator"),
        ("PodDisruptionBudget", f"{name}-engine"),
        ("NetworkPolicy", f"{name}-default-deny"), ("NetworkPolicy", f"{name}-frontend"),
        ("NetworkPolicy", f"{name}-coordinator"), ("NetworkPolicy", f"{name}-engine"),
    ])


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes_call_the_health_service_names(rendered: Any, case: str) -> None:
    objs = rendered(case)
    tls = case == "gpu-mtls-dp2"
    found = service_containers(objs)
    assert sorted(c["name"] for c in found) == ["coordinator", "engine", "frontend"]
    for c in found:
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        probe_port = ports["health"] if tls else ports["grpc"]
        if tls:
            assert f"--health-port={probe_port}" in c["args"]
            assert probe_port != ports["grpc"]
        for kind in PROBE_SERVICE_NAMES:
            probe = c[f"{kind}Probe"]
            assert probe["grpc"] == {"port": probe_port, "service": kind}, (c["name"], kind)
            assert probe["timeoutSeconds"] >= 5
    engine = next(c for c in found if c["name"] == "engine")
    startup = engine["startupProbe"]
    # A model load takes minutes: the engine gets at least 10 of them.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_container_is_locked_down(rendered: Any, case: str) -> None:
    workloads = [o for o in rendered(case) if o["kind"] in WORKLOADS]
    assert workloads
    for obj in workloads:
        spec = pod_spec(obj)
        assert spec is not None
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        mounts_needed = {"/tmp"}
        for c in containers(obj):
            sc = c.get("securityContext")
            assert sc, f"{obj['metadata']['name']}/{c['name']} has no securityContext"
            assert sc["runAsNonRoot"] is True
            assert sc["runAsUser"] != 0
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["privileged"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            if c["name"] in SERVICE_CONTAINERS:
                # With a read-only root, everything the process writes lands in emptyDirs.
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert mounts_needed | {env["CORESTREAM_CACHE_DIR"]} <= mounts
                assert env["TORCH_EXTENSIONS_DIR"].startswith(env["CORESTREAM_CACHE_DIR"])
    for sa in by_kind(rendered(case), "ServiceAccount").values():
        assert sa["automountServiceAccountToken"] is False


@pytest.mark.parametrize("case", sorted(CASES))
def test_termination_is_wired(rendered: Any, case: str) -> None:
    for obj in rendered(case):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(obj)
        assert spec is not None
        grace = spec["terminationGracePeriodSeconds"]
        (c,) = spec["containers"]
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = [int(a.split("=")[1]) for a in c["args"] if a.startswith("--shutdown-timeout=")]
        assert grace >= pre_stop + sum(drain) + 5, obj["metadata"]["name"]
        if c["name"] != "coordinator":  # the coordinator holds no requests to drain
            assert drain and drain[0] > 0


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_args_parse_with_the_real_cli(rendered: Any, case: str) -> None:
    # What the kubelet would put in the downward-API variables of rank 1.
    downward = {"metadata.name": f"{RELEASE}-engine-1", "metadata.namespace": NAMESPACE,
                "metadata.labels['apps.kubernetes.io/pod-index']": "1",
                "status.podIP": "10.1.2.3"}
    for c in service_containers(rendered(case)):
        env = {}
        for e in c["env"]:
            env[e["name"]] = e["value"] if "value" in e else downward[
                e["valueFrom"]["fieldRef"]["fieldPath"]]
        argv = [_expand(a, env) for a in c["args"]]
        assert not any("$(" in a for a in argv), argv
        command = argv[0]
        assert command == c["name"]
        args = build_parser().parse_args(argv)
        # Builds every config dataclass of the service: its validation runs too.
        configs = [from_args(cls, args) for cls in SERVICES[command][0]]
        assert configs
        # Internal services listen on the pod IP only; port-forward needs the frontend on all.
        assert args.host == ("0.0.0.0" if command == "frontend" else "10.1.2.3")
        if case == "gpu-mtls-dp2":
            assert (args.health_host, args.health_port) == ("10.1.2.3", 8081)
        if command == "engine":
            assert args.engine_index == 1
            assert args.advertise_address == (
                f"{RELEASE}-engine-1.{RELEASE}-engine.{NAMESPACE}.svc.cluster.local:50061")
        if command in ("engine", "frontend"):
            assert args.coordinator == (
                f"{RELEASE}-coordinator.{NAMESPACE}.svc.cluster.local:50050")


def test_engines_are_ranks_behind_a_headless_service(rendered: Any) -> None:
    objs = rendered("gpu-mtls-dp2")
    (sts,) = by_kind(objs, "StatefulSet").values()
    service = by_kind(objs, "Service")[sts["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    (engine,) = sts["spec"]["template"]["spec"]["containers"]
    assert engine["image"].endswith("-cuda")
    assert "--device=cuda" in engine["args"]
    # Rank 0's stable name hosts the group's rendezvous (MoE models split experts).
    assert "--data-parallel-size=2" in engine["args"]
    assert (f"--data-parallel-master={sts['metadata']['name']}-0.{service['metadata']['name']}"
            ".$(POD_NAMESPACE).svc.cluster.local:29500") in engine["args"]
    # One tensor-parallel group of two ranks per pod: a GPU and 4 CPUs for each rank.
    assert "--tensor-parallel-size=2" in engine["args"]
    for kind in ("requests", "limits"):
        assert engine["resources"][kind]["nvidia.com/gpu"] == 2
        assert engine["resources"][kind]["cpu"] == "8"
    spec = sts["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["priorityClassName"] == "llm-serving"
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["affinity"]["podAntiAffinity"]
    # Per-component override of the termination block.
    assert spec["terminationGracePeriodSeconds"] == 330
    assert "--shutdown-timeout=300" in engine["args"]
    for name in ("frontend", "coordinator"):
        (c,) = by_kind(objs, "Deployment")[f"{RELEASE}-{name}"]["spec"]["template"]["spec"][
            "containers"]
        assert c["image"].endswith("-slim"), "frontend and coordinator images carry no torch"


def test_tls_and_api_keys_reach_the_flags(rendered: Any) -> None:
    objs = rendered("gpu-mtls-dp2")
    for c in service_containers(objs):
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["tls"]["readOnly"] is True
        for flag, file in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"),
                           ("--tls-ca", "ca.crt")):
            assert f"{flag}={mounts['tls']['mountPath']}/{file}" in c["args"]
        assert "--otlp-endpoint=otel-collector.observability.svc:4317" in c["args"]
        assert "--trace-sample-ratio=0.05" in c["args"]
    frontend = by_kind(objs, "Deployment")[f"{RELEASE}-frontend"]
    (c,) = frontend["spec"]["template"]["spec"]["containers"]
    assert "--api-key-file=/etc/corestream/api-keys/api-keys" in c["args"]
    assert "--admin-api-key-file=/etc/corestream/admin-api-keys/keys" in c["args"]
    volumes = {v["name"]: v for v in frontend["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "corestream-tls"
    assert volumes["api-keys"]["secret"]["secretName"] == "corestream-api-keys"
    assert volumes["admin-api-keys"]["secret"]["secretName"] == "corestream-admin-api-keys"


def test_http_api_port_is_optional(rendered: Any) -> None:
    for case, enabled in (("default", False), ("gpu-mtls-dp2", True)):
        objs = rendered(case)
        frontend = by_kind(objs, "Deployment")[f"{RELEASE}-frontend"]
        (c,) = frontend["spec"]["template"]["spec"]["containers"]
        service = by_kind(objs, "Service")[f"{RELEASE}-frontend"]
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ("--http-port=8000" in c["args"]) is enabled
        assert ({"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]) \
            is enabled
        assert ("http" in ports) is enabled
        # Probes stay on gRPC.
        assert all("grpc" in c[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness"))
    assert ports["http"] == {"name": "http", "port": 8000, "targetPort": "http",
                             "protocol": "TCP", "appProtocol": "https"}


def test_model_volume_and_download(rendered: Any) -> None:
    objs = rendered("gpu-mtls-dp2")
    (pvc,) = by_kind(objs, "PersistentVolumeClaim").values()
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (job,) = by_kind(objs, "Job").values()
    job_spec = job["spec"]["template"]["spec"]
    (download,) = job_spec["containers"]
    env = {e["name"]: e for e in download["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    revision = env["REVISION"]["value"]
    assert {v["name"]: v for v in job_spec["volumes"]}["models"]["persistentVolumeClaim"] == {
        "claimName": pvc["metadata"]["name"]}
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet") or obj["metadata"]["name"].endswith(
                "coordinator"):
            continue
        spec = obj["spec"]["template"]["spec"]
        assert obj["spec"]["template"]["metadata"]["annotations"][
            "corestream.io/model-revision"] == revision
        (wait,) = spec["initContainers"]
        assert {e["name"]: e["value"] for e in wait["env"]}["REVISION"] == revision
        volume = {v["name"]: v for v in spec["volumes"]}["models"]["persistentVolumeClaim"]
        assert volume == {"claimName": pvc["metadata"]["name"], "readOnly": True}
        (c,) = spec["containers"]
        assert {m["name"]: m for m in c["volumeMounts"]}["models"]["readOnly"] is True
        assert "--model=/models/llama-3.2-1b-instruct" in c["args"]


def test_servicemonitor_scrapes_every_metrics_port(rendered: Any) -> None:
    objs = rendered("gpu-mtls-dp2")
    (monitor,) = by_kind(objs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    selected = [s for s in by_kind(objs, "Service").values()
                if selector.items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 3
    for service in selected:
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports[endpoint["port"]]["targetPort"] == "metrics"
    assert rendered("default") and not by_kind(rendered("default"), "ServiceMonitor")


def test_public_port_without_client_certificates_and_no_reflection(helm_binary: None) -> None:
    objs = render(CASES["gpu-mtls-dp2"], [
        'security.tls.requireClientCertOnFrontend=false', 'security.reflection=false'])
    args = {c["name"]: c["args"] for c in service_containers(tuple(objs))}
    assert "--no-require-client-cert" in args["frontend"]
    # Between the services client certificates stay required.
    assert "--no-require-client-cert" not in args["engine"] + args["coordinator"]
    assert all("--no-reflection" in a for a in args.values())


def _engine(objs: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine StatefulSet's pod spec and its engine container."""
    (sts,) = by_kind(objs, "StatefulSet").values()
    spec = sts["spec"]["template"]["spec"]
    (engine,) = spec["containers"]
    return spec, engine


def test_tensor_parallel_on_cpu(rendered: Any) -> None:
    spec, engine = _engine(rendered("cpu-tp2"))
    assert "--tensor-parallel-size=2" in engine["args"]
    assert "--device=cpu" in engine["args"]
    assert engine["image"].endswith("-cpu")
    # engine.cpusPerRank=4 for each of the two ranks; no GPU.
    assert engine["resources"] == {"requests": {"cpu": "8", "memory": "8Gi"},
                                   "limits": {"cpu": "8", "memory": "12Gi"}}
    # The ranks exchange step batches through a memory-backed /dev/shm.
    shm = {v["name"]: v for v in spec["volumes"]}["shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Mi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


def test_one_rank_by_default(rendered: Any) -> None:
    _, engine = _engine(rendered("default"))
    assert not [a for a in engine["args"] if a.startswith("--tensor-parallel-size")]
    # engine.cpusPerRank=2 x one rank.
    assert engine["resources"]["requests"]["cpu"] == engine["resources"]["limits"]["cpu"] == "2"


def test_cpus_from_engine_resources_are_not_multiplied(helm_binary: None) -> None:
    objs = render(set_json=["parallelism.tensorParallelSize=2", "engine.cpusPerRank=0",
                            'engine.resources={"requests": {"cpu": "1500m"}}'])
    _, engine = _engine(tuple(objs))
    assert "--tensor-parallel-size=2" in engine["args"]
    assert engine["resources"]["requests"]["cpu"] == "1500m"
    assert "cpu" not in engine["resources"]["limits"]
