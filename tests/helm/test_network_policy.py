"""The rendered NetworkPolicies, evaluated the way Kubernetes does, over a traffic matrix.

Policies are additive: a pod selected by any policy of a direction accepts only what
some rule of those policies allows; a pod selected by none accepts everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.helm.chart import NAMESPACE, pod_spec

pytestmark = [pytest.mark.usefixtures("helm_binary"), pytest.mark.timeout(120)]


@dataclass(frozen=True)
class Endpoint:
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels is evaluated here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict[str, Any], other: Endpoint) -> bool:
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != NAMESPACE:
        return False
    return _selects(peer.get("podSelector", {}), other.labels)


def _rule_allows(rule: dict[str, Any], peers_key: str, other: Endpoint, port: int,
                 protocol: str) -> bool:
    ports = rule.get("ports")
    if ports and not any(p["port"] == port and p.get("protocol", "TCP") == protocol
                         for p in ports):
        return False
    peers = rule.get(peers_key)
    return not peers or any(_peer_matches(p, other) for p in peers)


def _side_allows(policies: list[dict[str, Any]], pod: Endpoint, other: Endpoint, port: int,
                 protocol: str, direction: str) -> bool:
    if pod.namespace != NAMESPACE:
        return True  # the release's policies only govern its own namespace
    applying = [p for p in policies if _selects(p["spec"]["podSelector"], pod.labels)
                and direction in p["spec"]["policyTypes"]]
    if not applying:
        return True
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any(_rule_allows(rule, peers_key, other, port, protocol)
               for p in applying for rule in p["spec"].get(key, []))


def allowed(objs: tuple[dict[str, Any], ...], src: Endpoint, dst: Endpoint, port: int,
            protocol: str = "TCP") -> bool:
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return (_side_allows(policies, src, dst, port, protocol, "Egress")
            and _side_allows(policies, dst, src, port, protocol, "Ingress"))


def pods(objs: tuple[dict[str, Any], ...]) -> dict[str, Endpoint]:
    found = {}
    for obj in objs:
        if pod_spec(obj) is not None:
            labels = obj["spec"]["template"]["metadata"]["labels"]
            found[labels["app.kubernetes.io/component"]] = Endpoint(NAMESPACE, labels)
    return found


CLIENT_GATEWAY = Endpoint("gateway", {"app": "client"})
CLIENT_ELSEWHERE = Endpoint("default", {"app": "client"})
PROMETHEUS = Endpoint("monitoring", {"app": "prometheus"})
NEIGHBOUR = Endpoint(NAMESPACE, {"app": "something-else"})
KUBE_DNS = Endpoint("kube-system", {"k8s-app": "kube-dns"})
COLLECTOR = Endpoint("observability", {"app": "otel-collector"})
INTERNET = Endpoint("internet")


def test_default_deny_covers_every_pod(rendered: Any) -> None:
    for case in ("default", "gpu-mtls-dp2"):
        objs = rendered(case)
        (deny,) = [o for o in objs if o["kind"] == "NetworkPolicy"
                   and o["metadata"]["name"].endswith("-default-deny")]
        assert deny["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]
        for pod in pods(objs).values():
            assert _selects(deny["spec"]["podSelector"], pod.labels)


@pytest.mark.parametrize("case", ["default", "gpu-mtls-dp2"])
def test_only_the_cluster_links_are_open(rendered: Any, case: str) -> None:
    objs = rendered(case)
    p = pods(objs)
    frontend, coordinator, engine = p["frontend"], p["coordinator"], p["engine"]
    open_links = [
        (frontend, coordinator, 50050), (frontend, engine, 50061), (engine, coordinator, 50050),
        (CLIENT_GATEWAY, frontend, 50051),
        (frontend, KUBE_DNS, 53), (engine, KUBE_DNS, 53), (coordinator, KUBE_DNS, 53),
        *[(PROMETHEUS, pod, 9090) for pod in (frontend, coordinator, engine)],
    ]
    # DP > 1: the ranks form a process group (rendezvous, then gloo/NCCL pairs on
    # ephemeral ports), so engines reach each other; with one engine they must not.
    engine_to_engine = [(engine, engine, 29500), (engine, engine, 41234)]
    if case == "gpu-mtls-dp2":
        open_links += engine_to_engine
    # The HTTP API's port is open exactly where it is enabled.
    http_link = [(CLIENT_GATEWAY, frontend, 8000)]
    if case == "gpu-mtls-dp2":
        open_links += http_link
    closed_links = [
        *([] if case == "gpu-mtls-dp2" else http_link),
        (CLIENT_GATEWAY, engine, 8000), (CLIENT_GATEWAY, coordinator, 8000),
        *([] if case == "gpu-mtls-dp2" else [*engine_to_engine, (engine, engine, 50061)]),
        (coordinator, engine, 50061), (coordinator, frontend, 50051),
        (engine, frontend, 50051),
        (frontend, coordinator, 50061), (frontend, engine, 50050),
        (CLIENT_GATEWAY, engine, 50061), (CLIENT_GATEWAY, coordinator, 50050),
        (NEIGHBOUR, coordinator, 50050), (NEIGHBOUR, engine, 50061),
        (PROMETHEUS, engine, 50061),
        (frontend, INTERNET, 443), (engine, INTERNET, 443), (coordinator, INTERNET, 443),
    ]
    for src, dst, port in open_links:
        assert allowed(objs, src, dst, port), f"{src} -> {dst}:{port} should be open"
    assert allowed(objs, engine, KUBE_DNS, 53, "UDP")
    for src, dst, port in closed_links:
        assert not allowed(objs, src, dst, port), f"{src} -> {dst}:{port} should be closed"


def test_restricted_sources_and_tracing(rendered: Any) -> None:
    objs = rendered("gpu-mtls-dp2")
    p = pods(objs)
    # apiFrom and metricsFrom name namespaces: other sources are refused.
    assert allowed(objs, CLIENT_GATEWAY, p["frontend"], 50051)
    assert not allowed(objs, CLIENT_ELSEWHERE, p["frontend"], 50051)
    assert allowed(objs, PROMETHEUS, p["engine"], 9090)
    assert not allowed(objs, CLIENT_ELSEWHERE, p["engine"], 9090)
    for pod in (p["frontend"], p["coordinator"], p["engine"]):
        assert allowed(objs, pod, COLLECTOR, 4317)
    # Only the download Job reaches the Hub.
    assert allowed(objs, p["model-download"], INTERNET, 443)
    assert not allowed(objs, p["model-download"], p["engine"], 50061)
    # Default values: anyone may call the frontend.
    assert allowed(rendered("default"), CLIENT_ELSEWHERE, pods(rendered("default"))["frontend"],
                   50051)
