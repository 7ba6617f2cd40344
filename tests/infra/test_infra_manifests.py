"""The deployment files agree with the code: every command they run parses, every metric they chart exists."""

import json
import re
from pathlib import Path

import pytest
import yaml

from diptych_server.cli import _parser

INFRA = Path(__file__).resolve().parents[2] / "infra"
SOURCES_OF_METRICS = [INFRA.parent / "gateway" / "metrics.py", INFRA.parent / "workers" / "metrics.py"]


def _k8s_documents():
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            yield path.name, document


def _containers():
    for name, document in _k8s_documents():
        if document["kind"] == "Deployment":
            spec = document["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield name, container
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    for service, definition in compose["services"].items():
        if definition.get("image", "").startswith("diptych") and "command" in definition:
            yield f"compose:{service}", {"args": definition["command"]}


@pytest.mark.parametrize("source, container", list(_containers()), ids=lambda value: str(value)[:40])
def test_every_diptych_command_parses(source, container):
    if "args" not in container:
        return  # a plain command such as manage.py migrate
    args = [re.sub(r"\$\((\w+)\)", "10.0.0.1", arg) for arg in container["args"]]
    _parser().parse_args(args)


def _family(name: str) -> str:
    """A metric's family name: what Prometheus appends to counters and histograms taken off."""
    return re.sub(r"_(bucket|count|sum|total)$", "", name)


def _exported_metric_names() -> set[str]:
    names = set()
    for path in SOURCES_OF_METRICS:
        names.update(_family(name) for name in re.findall(r'"(diptych_[a-z_]+)"', path.read_text()))
    return names


def _referenced_metric_names() -> set[str]:
    texts = [(INFRA / "prometheus" / "adapter-rules.yaml").read_text()]
    dashboard = json.loads((INFRA / "grafana" / "diptych-serving.json").read_text())
    texts += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    names = set()
    for text in texts:
        for name in re.findall(r"\b(diptych_[a-z_]+)", text):
            names.add(_family(name))
    return names


def test_dashboard_and_autoscaling_use_metrics_the_code_exports():
    derived = {"diptych_worker_kv_blocks_used_ratio"}  # computed by the adapter rule itself
    missing = _referenced_metric_names() - _exported_metric_names() - derived
    assert not missing, f"charted or scaled on but never exported: {sorted(missing)}"


def test_fleet_autoscalers_target_their_deployments():
    documents = list(_k8s_documents())
    deployments = {d["metadata"]["name"] for _, d in documents if d["kind"] == "Deployment"}
    for _, document in documents:
        if document["kind"] == "HorizontalPodAutoscaler":
            assert document["spec"]["scaleTargetRef"]["name"] in deployments


# ---- network policies: only the gateway reaches worker gRPC, only prefill workers the KV data port ----

STRANGER = {"app": "stranger"}  # any other pod in the namespace, e.g. a tenant's notebook


def _template_labels() -> dict[str, dict]:
    """Each Deployment's pod labels, by Deployment name."""
    return {
        document["metadata"]["name"]: document["spec"]["template"]["metadata"]["labels"]
        for _, document in _k8s_documents() if document["kind"] == "Deployment"
    }


def _named_ports(deployment: str) -> dict[str, int]:
    for _, document in _k8s_documents():
        if document["kind"] == "Deployment" and document["metadata"]["name"] == deployment:
            containers = document["spec"]["template"]["spec"]["containers"]
            return {port["name"]: port["containerPort"] for c in containers for port in c.get("ports", [])}
    raise KeyError(deployment)


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value_in = labels.get(expression["key"]) in expression.get("values", [])
        outcome = {"In": present and value_in, "NotIn": not value_in, "Exists": present,
                   "DoesNotExist": not present}[expression["operator"]]
        if not outcome:
            return False
    return True


def _peer_admits(peer: dict, source: dict, same_namespace: bool) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by IP blocks here
    if "namespaceSelector" not in peer and not same_namespace:
        return False
    return _selects(peer.get("podSelector", {}), source)


def _port_admits(rule_ports: list | None, port_name: str, port_number: int) -> bool:
    return rule_ports is None or any(p.get("port") in (port_name, port_number) for p in rule_ports)


def _reachable(target: dict, port_name: str, port_number: int, source: dict, same_namespace: bool = True) -> bool:
    """Whether a pod with `source` labels may open `port` on a pod with `target` labels."""
    policies = [d for _, d in _k8s_documents() if d["kind"] == "NetworkPolicy"
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"]) and _selects(d["spec"]["podSelector"], target)]
    if not policies:
        return True  # no policy selects the pod: everything reaches it
    return any(
        _port_admits(rule.get("ports"), port_name, port_number)
        and any(_peer_admits(peer, source, same_namespace) for peer in rule.get("from", [{}]))
        for policy in policies for rule in policy["spec"].get("ingress", [])
    )


def test_only_the_gateway_reaches_worker_grpc_and_only_prefill_workers_reach_kv_data():
    labels = _template_labels()
    gateway, control_plane = labels["gateway"], labels["control-plane"]
    prefill, decode = labels["prefill-diptych-tiny"], labels["decode-diptych-tiny"]
    prefill_ports, decode_ports = _named_ports("prefill-diptych-tiny"), _named_ports("decode-diptych-tiny")
    for worker, ports in ((prefill, prefill_ports), (decode, decode_ports)):
        assert _reachable(worker, "grpc", ports["grpc"], gateway)
        for outsider in (control_plane, STRANGER):
            assert not _reachable(worker, "grpc", ports["grpc"], outsider)
            assert not _reachable(worker, "grpc", ports["grpc"], outsider, same_namespace=False)
    assert _reachable(decode, "grpc", decode_ports["grpc"], prefill)  # GetKvEndpoint
    assert not _reachable(prefill, "grpc", prefill_ports["grpc"], decode)
    assert _reachable(decode, "kv-data", decode_ports["kv-data"], prefill)
    for outsider in (gateway, control_plane, decode, STRANGER):
        assert not _reachable(decode, "kv-data", decode_ports["kv-data"], outsider)


def test_prometheus_still_scrapes_the_workers():
    labels = _template_labels()
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for deployment in ("prefill-diptych-tiny", "decode-diptych-tiny"):
        port = _named_ports(deployment)["metrics"]
        assert _reachable(labels[deployment], "metrics", port, prometheus, same_namespace=False)
        assert not _reachable(labels[deployment], "metrics", port, STRANGER)


def test_network_policy_ports_name_ports_the_workers_declare():
    declared = set(_named_ports("prefill-diptych-tiny")) | set(_named_ports("decode-diptych-tiny"))
    for _, document in _k8s_documents():
        if document["kind"] == "NetworkPolicy":
            for rule in document["spec"]["ingress"]:
                for port in rule.get("ports", []):
                    assert port["port"] in declared, f"{document['metadata']['name']} names an unknown port"
