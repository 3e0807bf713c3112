"""The chart's containers run as local processes: its flags, env and probes against the
real services.

Each rendered pod becomes a process whose POD_IP is 127.0.0.1, started with exactly the
container's args and env. Two things a cluster provides are stood in for: DNS (the
in-cluster names of the release's Services resolve to 127.0.0.1) and volumes (each
mountPath maps to a local folder holding what its Secret, ConfigMap or emptyDir would).
Then the test does what the kubelet and a client would: the gRPC probes on the ports and
service names the pod spec names, a request with mTLS and an API key, a chat rendered with
the template from the values, a metrics scrape, and SIGTERM with the pod's grace period.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.certs import issue, make_authority
from tests.helm.chart import NAMESPACE, RELEASE, ROOT, containers, render
from tests.integration.cluster import free_port

pytestmark = [pytest.mark.usefixtures("helm_binary"), pytest.mark.timeout(300)]

COMPONENTS = ("coordinator", "engine", "frontend")
API_KEY = "test-key-0123456789"
SERVING = health_pb2.HealthCheckResponse.SERVING
# Replaces the built-in checkpoint's own (hermes-style) template: the prompt shows which ran.
CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
# The emptyDir cache outlives the test, so the engine's CPU kernel is compiled once.
CACHE = Path.home() / ".cache" / "corestream-helm-pods"


@dataclass
class Pod:
    component: str
    container: dict[str, Any]
    grace_s: int
    process: subprocess.Popen[bytes]
    log: Path

    def probe(self, kind: str) -> dict[str, Any]:
        return self.container[f"{kind}Probe"]

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def write_pki(folder: Path) -> dict[str, bytes]:
    """One certificate for every service, as the chart's TLS Secret holds (tls.crt...)."""
    ca = make_authority()
    cert, key = issue(ca, "corestream", hosts=(
        "127.0.0.1", "localhost", f"{RELEASE}-coordinator.{NAMESPACE}.svc.cluster.local",
        f"*.{RELEASE}-engine.{NAMESPACE}.svc.cluster.local"))
    files = {
        "ca.crt": ca.cert.public_bytes(serialization.Encoding.PEM),
        "tls.crt": cert.public_bytes(serialization.Encoding.PEM),
        "tls.key": key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()),
    }
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def resolve(text: str) -> str:
    """The cluster DNS of the release: its Services' names (and the engine pods' names
    under the headless Service) are 127.0.0.1 here."""
    return re.sub(rf"[\w.-]+\.{NAMESPACE}\.svc\.cluster\.local", "127.0.0.1", text)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def start(component: str, obj: dict[str, Any], tmp: Path, secrets: dict[str, dict[str, bytes]],
          config_maps: dict[str, dict[str, str]]) -> Pod:
    (container,) = [c for c in containers(obj, init=False) if c["name"] == component]
    pod_name = f"{RELEASE}-engine-0" if component == "engine" else f"{RELEASE}-{component}-x"
    downward = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE,
                "status.podIP": "127.0.0.1",
                "metadata.labels['apps.kubernetes.io/pod-index']": "0"}
    volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
    mounts: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if mount["mountPath"] in ("/tmp", "/dev/shm"):
            continue
        if "secret" in volume:
            folder = tmp / component / mount["name"]
            folder.mkdir(parents=True)
            for name, data in secrets[volume["secret"]["secretName"]].items():
                (folder / name).write_bytes(data)
        elif "configMap" in volume:
            folder = tmp / component / mount["name"]
            folder.mkdir(parents=True)
            for name, text in config_maps[volume["configMap"]["name"]].items():
                (folder / name).write_text(text)
        else:
            assert "emptyDir" in volume, (
                f"{mount['name']}: only emptyDirs, Secrets and ConfigMaps here")
            folder = CACHE / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = str(folder)

    def local(text: str) -> str:
        for path, folder in mounts.items():
            text = text.replace(path, folder)
        return text

    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = local(expand(item["value"], env))
        else:
            env[item["name"]] = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
    argv = [local(resolve(expand(a, env))) for a in container["args"]]
    log = tmp / f"{component}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, **env})
    grace = obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    return Pod(component, container, grace, process, log)


def check(port: int, service: str, timeout: float) -> int | None:
    """One kubelet gRPC probe: plaintext grpc.health.v1 Check; None when it cannot connect."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        except grpc.RpcError:
            return None


def wait_until_serving(pod: Pod, kind: str, deadline: float) -> None:
    probe = pod.probe(kind)
    while time.monotonic() < deadline:
        assert pod.process.poll() is None, f"{pod.component} exited:\n{pod.output()}"
        status = check(probe["grpc"]["port"], probe["grpc"]["service"], probe["timeoutSeconds"])
        if status == SERVING:
            return
        time.sleep(0.5)
    pytest.fail(f"{pod.component} {kind} probe never passed:\n{pod.output()}")


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pod]]:
    tmp = tmp_path_factory.mktemp("pods")
    secrets = {
        "corestream-tls": write_pki(tmp / "pki"),
        "corestream-api-keys": {"api-keys": f"# one key per line\n{API_KEY}\n".encode()},
    }
    ports = {c: free_port() for c in COMPONENTS}
    values = {
        "security": {"tls": {"enabled": True, "existingSecret": "corestream-tls"},
                     "apiKeys": {"existingSecret": "corestream-api-keys"}},
        # A collector that is not there must not hold anything up.
        "tracing": {"enabled": True, "otlpEndpoint": f"127.0.0.1:{free_port()}"},
        "engine": {"kvCacheMemory": "64MiB"},
        **{c: {"port": port} for c, port in ports.items()},
    }
    values["frontend"] = {**values["frontend"], "http": {"enabled": True, "port": free_port()},
                          "chatTemplate": {"template": CHAT_TEMPLATE}}
    started: dict[str, Pod] = {}
    try:
        for component in COMPONENTS:
            # Pods have their own network namespaces; local processes share one, so each
            # gets its own metrics and health ports through its own render.
            own = {"metrics": {"port": free_port()},
                   "security": {**values["security"], "healthPort": free_port()}}
            objs = render(set_json=[f"{k}={json.dumps(v)}" for k, v in {**values, **own}.items()])
            (obj,) = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                      and o["metadata"]["name"] == f"{RELEASE}-{component}"]
            config_maps = {o["metadata"]["name"]: o["data"] for o in objs
                           if o["kind"] == "ConfigMap"}
            started[component] = start(component, obj, tmp, secrets, config_maps)
        deadline = time.monotonic() + 240
        for pod in started.values():
            wait_until_serving(pod, "startup", deadline)
        yield started
    finally:
        for pod in started.values():
            if pod.process.poll() is None:
                pod.process.kill()
                pod.process.wait(timeout=30)


def client_credentials(frontend: Pod) -> grpc.ChannelCredentials:
    """mTLS with the certificate the pods hold (the chart's TLS Secret)."""
    pki = {name: (frontend.log.parent / "frontend" / "tls" / name).read_bytes()
           for name in ("ca.crt", "tls.crt", "tls.key")}
    return grpc.ssl_channel_credentials(
        root_certificates=pki["ca.crt"], private_key=pki["tls.key"],
        certificate_chain=pki["tls.crt"])


def test_probes_pass_on_the_health_port(pods: dict[str, Pod]) -> None:
    deadline = time.monotonic() + 120
    for pod in pods.values():
        for kind in ("startup", "readiness", "liveness"):
            wait_until_serving(pod, kind, deadline)
        probe_port = pod.probe("readiness")["grpc"]["port"]
        assert probe_port == pod.port("health") != pod.port("grpc")
        # The main port speaks TLS only: a plaintext probe there could never pass.
        assert check(pod.port("grpc"), "readiness", 5) is None


def test_generate_with_mtls_and_an_api_key(pods: dict[str, Pod]) -> None:
    frontend = pods["frontend"]
    with grpc.secure_channel(f"127.0.0.1:{frontend.port('grpc')}",
                             client_credentials(frontend)) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        request = pb.GenerateRequest(
            text="hello", sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4,
                                                             ignore_eos=True))
        deadline = time.monotonic() + 120
        while True:  # until the frontend has learnt the engine from the coordinator
            try:
                response = stub.Generate(request, timeout=60,
                                         metadata=[("authorization", f"Bearer {API_KEY}")])
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert len(response.completions[0].token_ids) == 4
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_chat_renders_with_the_template_from_the_values(pods: dict[str, Pod]) -> None:
    frontend = pods["frontend"]
    with grpc.secure_channel(f"127.0.0.1:{frontend.port('grpc')}",
                             client_credentials(frontend)) as channel:
        response = chat_grpc.ChatServiceStub(channel).RenderChat(
            chat_pb.RenderChatRequest(messages=[
                chat_pb.ChatMessage(role="system", content="Be brief."),
                chat_pb.ChatMessage(role="user", content="Hi")]),
            timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")])
    assert response.prompt == "<system>Be brief.<user>Hi"


def test_http_api_with_mtls_and_an_api_key(pods: dict[str, Pod]) -> None:
    frontend = pods["frontend"]
    tls = frontend.log.parent / "frontend" / "tls"
    body = json.dumps({"model": "tiny-llama-v2", "prompt": "hello", "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
    context.load_cert_chain(str(tls / "tls.crt"), str(tls / "tls.key"))
    url = f"https://127.0.0.1:{frontend.port('http')}/v1/completions"

    def post(headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(url, data=body, headers={
            "Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=60, context=context) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    deadline = time.monotonic() + 120
    while True:  # until the frontend has learnt the engine from the coordinator
        status, reply = post({"Authorization": f"Bearer {API_KEY}"})
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 4
    assert post({})[0] == 401


def test_metrics_are_scraped_on_the_metrics_port(pods: dict[str, Pod]) -> None:
    for pod in pods.values():
        url = f"http://127.0.0.1:{pod.port('metrics')}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert "# TYPE" in response.read().decode()


def test_sigterm_ends_every_pod_within_its_grace_period(pods: dict[str, Pod]) -> None:
    # Reverse start order, as a rollout of the whole release would not guarantee either.
    for pod in reversed(list(pods.values())):
        pod.process.send_signal(signal.SIGTERM)
        try:
            code = pod.process.wait(timeout=pod.grace_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{pod.component} outlived its {pod.grace_s} s grace period:\n"
                        f"{pod.output()}")
        assert code == 0, f"{pod.component} exited {code}:\n{pod.output()}"
