"""The chart's per-phase autoscaling: each autoscaled fleet follows the gateways' decision for its model, role
and region (an HPA on the External metric through prometheus-adapter, or a KEDA ScaledObject), the gateways
get the SLO targets and the policy the chart derives from the fleets, and bad autoscaling values fail."""

import json

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from diptych_server.cli import _parser
from planner.autoscale import FleetKey, FleetLimits
from planner.autoscale_policy import policy_from_json
from tests.infra.chart import RELEASE, REPO, default_objects, install_values, render

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
