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
