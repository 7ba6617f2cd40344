"""Renders infra/helm/diptych with Helm's own template engine (Helm's Go SDK, bound by helm-python-sdk) and
parses the result into the objects an install would send to the cluster."""

import copy
from functools import cache
from pathlib import Path

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "infra" / "helm" / "diptych"
RELEASE = "diptych"
NAMESPACE = "diptych"
# What an install must give (values.yaml marks them REQUIRED).
INSTALL_SECRETS = {
    "databaseUrl": "postgres://diptych:pw@postgres.example.internal:5432/diptych",
    "secretKey": "a-secret-key",
    "internalToken": "an-internal-token",
    "celeryBrokerUrl": "redis://redis.example.internal:6379/1",
    "redisUrl": "redis://redis.example.internal:6379/0",
}


def install_values(**overrides) -> dict:
    """The chart's defaults with the required secrets and fleet tokens filled in, then `overrides`
    (top-level keys replaced; `secrets` merged)."""
    with helm.Chart.load(str(CHART)) as chart:
        values = copy.deepcopy(chart.values)
    values["secrets"].update(INSTALL_SECRETS)
    for fleet in values["fleets"]:
        fleet["fleetToken"] = f"dft_{fleet['name']}"
    secrets = overrides.pop("secrets", {})
    values.update(overrides)
    values["secrets"].update(secrets)
    return values


def render(values: dict) -> list[dict]:
    """Every object the chart makes with `values`, hooks included, in template order."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        document
        for name, text in sorted(files.items())
        if name.endswith(".yaml")
        for document in yaml.safe_load_all(text)
        if document
    ]


@cache
def _default_objects() -> tuple[dict, ...]:
    return tuple(render(install_values()))


def default_objects() -> list[dict]:
    """The objects of an install with the default values (a copy: tests may change it)."""
    return copy.deepcopy(list(_default_objects()))
