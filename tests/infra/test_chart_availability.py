"""The chart keeps the replicated components serving through node failures and drains: the gateway's and the
control plane's replicas prefer different nodes, a disruption budget lets a drain take one of them at a time
(and never blocks a drain for good), and every long-running container has a memory limit, so that a leak ends
in a restart of that pod instead of the node's other pods being evicted."""

import kubernetes_validate
import pytest

from tests.infra.chart import RELEASE, default_objects, install_values, render

REPLICATED = {"gateway": "StatefulSet", "control-plane": "Deployment"}
LONG_RUNNING = {"Deployment", "StatefulSet"}
BINARY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _workload(objects, component: str) -> dict:
    (found,) = [
        d for d in objects if d["kind"] == REPLICATED[component] and d["metadata"]["name"] == f"{RELEASE}-{component}"
    ]
    return found


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # the chart selects by labels only
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def _budgets_of(objects, pod_labels: dict) -> list[dict]:
    return [d for d in objects if d["kind"] == "PodDisruptionBudget" and _selects(d["spec"]["selector"], pod_labels)]


def _disruptions_allowed(budget: dict, replicas: int) -> int:
    """Pods a drain may evict at once with all `replicas` healthy (integer budgets, as the chart writes them)."""
    spec = budget["spec"]
    if "maxUnavailable" in spec:
        return spec["maxUnavailable"]
    return replicas - spec["minAvailable"]


@pytest.mark.parametrize("component", sorted(REPLICATED))
def test_replicas_prefer_different_nodes(component):
    objects = default_objects()
    workload = _workload(objects, component)
    assert workload["spec"]["replicas"] == install_values()[_values_key(component)]["replicas"] == 2
    pod = workload["spec"]["template"]
    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti  # a one-node cluster still runs both
    (preferred,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and preferred["weight"] > 0
    assert _selects(term["labelSelector"], pod["metadata"]["labels"])
    others = [d for d in objects if d["kind"] in LONG_RUNNING and d["metadata"] != workload["metadata"]]
    assert not [d for d in others if _selects(term["labelSelector"], d["spec"]["template"]["metadata"]["labels"])]


@pytest.mark.parametrize("component", sorted(REPLICATED))
def test_a_drain_takes_one_replica_at_a_time_and_a_single_replica_does_not_block_it(component):
    objects = default_objects()
    labels = _workload(objects, component)["spec"]["template"]["metadata"]["labels"]
    (budget,) = _budgets_of(objects, labels)
    assert _disruptions_allowed(budget, replicas=2) == 1
    values = install_values()
    values[_values_key(component)]["replicas"] = 1
    single = render(values)
    (budget,) = _budgets_of(single, _workload(single, component)["spec"]["template"]["metadata"]["labels"])
    assert _disruptions_allowed(budget, replicas=1) >= 1
    for document in single:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def _values_key(component: str) -> str:
    return {"gateway": "gateway", "control-plane": "controlPlane"}[component]


def _bytes(quantity: str) -> int:
    for unit, factor in BINARY_UNITS.items():
        if quantity.endswith(unit):
            return int(quantity.removesuffix(unit)) * factor
    return int(quantity)


def test_every_long_running_container_has_a_memory_limit_at_or_above_its_request():
    checked = set()
    for document in default_objects():
        if document["kind"] not in LONG_RUNNING:
            continue
        for container in document["spec"]["template"]["spec"]["containers"]:
            where = f"{document['metadata']['name']}/{container['name']}"
            resources = container.get("resources", {})
            limit, request = resources.get("limits", {}).get("memory"), resources.get("requests", {}).get("memory")
            assert limit and request, f"{where}: requests {request}, limit {limit}"
            assert _bytes(limit) >= _bytes(request), f"{where}: limit {limit} below request {request}"
            checked.add(document["metadata"]["name"])
    assert {f"{RELEASE}-gateway", f"{RELEASE}-jobs"} <= checked
