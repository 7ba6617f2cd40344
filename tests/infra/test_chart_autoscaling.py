"""The chart's per-phase autoscaling: each autoscaled fleet follows the gateways' decision for its model, role
and region (an HPA on the External metric through prometheus-adapter, or a KEDA ScaledObject), the gateways
get the SLO targets and the policy the chart derives from the fleets, and bad autoscaling values fail."""

import json
import re

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from diptych_server.cli import _parser
from gateway.autoscale.decision import FleetKey, FleetLimits
from gateway.autoscale.policy_file import policy_from_json
from tests.infra.chart import CHART, RELEASE, REPO, default_objects, install_values, render

METRIC = "diptych_autoscale_desired_replicas"
ADAPTER_RULES = REPO / "infra" / "prometheus" / "adapter-rules.yaml"


def _by_kind(objects, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in objects if d["kind"] == kind}


def _gateway_container(objects) -> dict:
    (container,) = _by_kind(objects, "StatefulSet")[f"{RELEASE}-gateway"]["spec"]["template"]["spec"]["containers"]
    return container


def _values_with_autoscaling(**changes) -> dict:
    values = install_values()
    values["autoscaling"] = {**values["autoscaling"], **changes}
    return values


def test_each_autoscaled_fleet_s_hpa_follows_the_desired_replicas_of_its_model_role_and_region():
    objects = default_objects()
    values = install_values()
    autoscalers = _by_kind(objects, "HorizontalPodAutoscaler")
    assert set(autoscalers) == {f"{RELEASE}-{fleet['name']}" for fleet in values["fleets"] if fleet["maxReplicas"]}
    for fleet in values["fleets"]:
        spec = autoscalers[f"{RELEASE}-{fleet['name']}"]["spec"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"] == {
            "name": METRIC,
            "selector": {"matchLabels": {"model": fleet["model"], "role": fleet["role"], "region": fleet["region"]}},
        }
        # AverageValue 1: the HPA's desired replicas = ceil(metric / 1) = the decision itself
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (fleet["replicas"], fleet["maxReplicas"])
        assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 60


def test_prometheus_adapter_is_an_optional_dependency_whose_rules_serve_every_metric_the_hpas_read():
    """Chart.yaml names prometheus-adapter, off by default behind a condition whose values key exists; its
    values' external rules are infra's, and each serves one External metric an HPA reads, grouped by every
    label the HPA selects on. The chart renders without the dependency fetched (no charts/ directory)."""
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    declared = [d for d in chart_yaml.get("dependencies", []) if d["name"] == "prometheus-adapter"]
    assert len(declared) == 1, "Chart.yaml must declare prometheus-adapter once"
    (dependency,) = declared
    assert dependency["repository"] == "https://prometheus-community.github.io/helm-charts"
    assert re.fullmatch(r"\d+\.\d+\.\d+", dependency["version"]), "pin the dependency's version"
    key = dependency.get("alias", dependency["name"])
    assert dependency["condition"] == f"{key}.enabled"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    adapter = values[key]
    assert adapter["enabled"] is False  # optional: an install that wants it turns it on
    rules = adapter["rules"]["external"]
    assert {"externalRules": rules} == yaml.safe_load(ADAPTER_RULES.read_text())
    served = {rule["name"]["as"]: rule for rule in rules}
    autoscalers = _by_kind(default_objects(), "HorizontalPodAutoscaler")
    assert autoscalers
    for name, hpa in autoscalers.items():
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "External", name
            read = metric["external"]["metric"]
            rule = served.get(read["name"])
            assert rule is not None, f"{name} reads {read['name']}, which no adapter rule serves"
            assert rule["seriesQuery"].startswith(read["name"] + "{")
            (grouped,) = re.findall(r"by \(([^)]*)\)", rule["metricsQuery"])
            assert set(read["selector"]["matchLabels"]) <= {label.strip() for label in grouped.split(",")}, name
    assert [d["status"] for d in helm.dependency_list(CHART)] == ["missing"]  # rendered above without it


def test_the_adapter_rule_in_the_chart_is_infra_s_and_takes_the_highest_desired_count_over_the_gateways():
    rules = yaml.safe_load(
        _by_kind(default_objects(), "ConfigMap")[f"{RELEASE}-prometheus-adapter-rules"]["data"]["config.yaml"]
    )
    assert rules == yaml.safe_load(ADAPTER_RULES.read_text())
    (rule,) = rules["externalRules"]
    assert rule["name"]["as"] == METRIC
    assert rule["metricsQuery"].startswith(f"max({METRIC}{{")
    assert rule["metricsQuery"].endswith("by (model, role, region)")


def test_the_gateways_get_the_slo_targets_and_the_policy_derived_from_the_fleets():
    values = _values_with_autoscaling(sloTtftMs=750, sloTpotMs=40, targets={"queue_per_worker": 2})
    values["fleets"][0]["baseline"] = 3
    values["fleets"][1]["maxRunning"] = 32
    objects = render(values)
    container = _gateway_container(objects)
    args = _parser().parse_args(container["args"])
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (750, 40)
    (mount,) = [m for m in container["volumeMounts"] if str(args.autoscale_policy).startswith(m["mountPath"] + "/")]
    pod = _by_kind(objects, "StatefulSet")[f"{RELEASE}-gateway"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = _by_kind(objects, "ConfigMap")[volume["configMap"]["name"]]
    policy = policy_from_json(json.loads(config_map["data"][args.autoscale_policy.name]))
    prefill, decode = values["fleets"]
    assert policy.limits(FleetKey(prefill["model"], "prefill", prefill["region"])) == FleetLimits(
        min_replicas=2, max_replicas=16, baseline=3
    )
    assert policy.limits(FleetKey(decode["model"], "decode", decode["region"])).max_running == 32
    (worker,) = _by_kind(objects, "Deployment")[f"{RELEASE}-{decode['name']}"]["spec"]["template"]["spec"]["containers"]
    assert _parser().parse_args(worker["args"]).max_running == 32  # the decision's max_running is the worker's
    assert policy.targets.queue_per_worker == 2
    assert policy.scale_down_window_s == 300
    for document in objects:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_a_changed_policy_rolls_the_gateways():
    def checksum(values):
        template = _by_kind(render(values), "StatefulSet")[f"{RELEASE}-gateway"]["spec"]["template"]
        return template["metadata"]["annotations"]["checksum/autoscale-policy"]

    assert checksum(install_values()) != checksum(_values_with_autoscaling(scaleDownWindowSeconds=600))


def test_keda_scales_each_fleet_on_the_same_decision_in_place_of_the_hpa():
    objects = render(_values_with_autoscaling(kind="keda", prometheusUrl="http://prometheus.monitoring:9090"))
    assert not _by_kind(objects, "HorizontalPodAutoscaler")
    assert f"{RELEASE}-prometheus-adapter-rules" not in _by_kind(objects, "ConfigMap")
    scaled = _by_kind(objects, "ScaledObject")
    (prefill,) = [s for name, s in scaled.items() if name.endswith("tiny-prefill")]
    spec = prefill["spec"]
    assert spec["scaleTargetRef"] == {"name": f"{RELEASE}-tiny-prefill"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 16)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert trigger["metadata"]["query"] == (
        f'max({METRIC}{{namespace="diptych",model="diptych-tiny",role="prefill",region="us-east-1"}})'
    )
    for document in objects:
        if document["kind"] != "ScaledObject":  # KEDA's own resource: not in the Kubernetes schema
            kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def _same_key_twice() -> dict:
    values = install_values()
    values["fleets"].append({**values["fleets"][0], "name": "tiny-prefill-b", "hardwareClass": "a100"})
    return values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (lambda: _values_with_autoscaling(kind="vpa"), "autoscaling.kind must be hpa or keda"),
        (lambda: _values_with_autoscaling(kind="keda"), "set autoscaling.prometheusUrl"),
        (_same_key_twice, r"fleets\[tiny-prefill\] and fleets\[tiny-prefill-b\] are both autoscaled"),
        (
            lambda: install_values(
                autoscaling={**install_values()["autoscaling"], "kind": "keda", "prometheusUrl": "http://p:9090"},
                prometheusAdapter={**install_values()["prometheusAdapter"], "enabled": True},
            ),
            "prometheusAdapter.enabled is for autoscaling.kind hpa",
        ),
    ],
)
def test_bad_autoscaling_values_fail_naming_them(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values())


def test_a_baseline_above_the_fleet_s_maximum_fails_naming_it():
    values = install_values()
    values["fleets"][1]["baseline"] = 17
    with pytest.raises(helm.HelmError, match=r"fleets\[tiny-decode\].baseline 17 is above its maxReplicas 16"):
        render(values)
