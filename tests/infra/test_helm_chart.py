"""The Helm chart (infra/helm/diptych): it lints, every object it renders is valid against the Kubernetes
schema, and it keeps the deployment's rules: values per fleet, migrations as a hook Job, secrets scoped per
component, the usage spool on a PersistentVolumeClaim, pinned images, GPU fleets on the CUDA image."""

import helm_python as helm
import kubernetes_validate
import pytest

from tests.infra.chart import CHART, RELEASE, default_objects, install_values, render

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; gRPC probes are GA from 1.27) and the
# newest whose schema kubernetes-validate bundles.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
WORKLOADS = {"Deployment", "StatefulSet", "Job"}


def _containers(objects):
    for document in objects:
        if document["kind"] in WORKLOADS:
            spec = document["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield document, container


def _by_name(objects, kind: str, name: str) -> dict:
    (found,) = [d for d in objects if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_the_chart_lints_without_errors():
    result = helm.lint(str(CHART), values=install_values())
    assert result["errors"] == [], result["messages"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_against_the_kubernetes_schema(version):
    objects = default_objects()
    assert {d["kind"] for d in objects} >= {
        "Deployment",
        "StatefulSet",
        "Job",
        "Service",
        "Secret",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for document in objects:
        # strict: a field the schema does not know (a typo, a misplaced key) is an error too
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"secrets": {"databaseUrl": ""}}, "set secrets.databaseUrl"),
        ({"secrets": {"redisUrl": ""}}, "set secrets.redisUrl"),
        ({"image": {"repository": "diptych", "tag": "latest", "cudaTag": "0.1.0-cuda"}}, "must pin a version"),
        ({"image": {"repository": "diptych", "tag": "0.1.0", "cudaTag": ""}}, "must pin a version"),
    ],
)
def test_an_install_missing_a_required_value_fails_naming_it(overrides, message):
    with pytest.raises(helm.HelmError, match=message):
        render(install_values(**overrides))


def test_a_fleet_with_an_unknown_role_or_hardware_fails_naming_it():
    values = install_values()
    values["fleets"][0]["role"] = "prefil"
    with pytest.raises(helm.HelmError, match=r"fleets\[tiny-prefill\].role must be prefill, decode or colocated"):
        render(values)
    values = install_values()
    values["fleets"][1]["hardware"] = "tpu"
    with pytest.raises(helm.HelmError, match=r"fleets\[tiny-decode\].hardware must be cpu or gpu"):
        render(values)
    values = install_values()
    values["fleets"][1]["fleetToken"] = ""
    with pytest.raises(helm.HelmError, match=r"set fleets\[tiny-decode\].fleetToken"):
        render(values)


def test_every_image_is_pinned():
    for document, container in _containers(default_objects()):
        repository, _, tag = container["image"].rpartition(":")
        assert repository and tag and tag != "latest", f"{document['metadata']['name']}: {container['image']}"


def test_migrations_run_once_as_a_hook_job_before_the_control_plane_starts():
    objects = default_objects()
    for document, container in _containers(objects):
        if document["kind"] != "Job":
            assert "migrate" not in container.get("command", []), f"{document['metadata']['name']} migrates"
            assert not document["spec"]["template"]["spec"].get("initContainers"), document["metadata"]["name"]
    job = _by_name(objects, "Job", f"{RELEASE}-migrate")
    assert set(job["metadata"]["annotations"]["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "manage.py", "migrate", "--noinput"]
    # Hooks run before the release's other objects exist: the Job's Secret is a hook that runs first.
    (source,) = container["envFrom"]
    secret = _by_name(objects, "Secret", source["secretRef"]["name"])
    assert "pre-install" in secret["metadata"]["annotations"]["helm.sh/hook"]
    weight = int(secret["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert weight < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert set(secret["stringData"]) == {"DATABASE_URL", "DIPTYCH_SECRET_KEY"}


# What each component's Secret holds: only the keys that component reads.
SCOPED_SECRETS = {
    f"{RELEASE}-control-plane": {
        "DATABASE_URL",
        "DIPTYCH_SECRET_KEY",
        "DIPTYCH_INTERNAL_TOKEN",
        "CELERY_BROKER_URL",
        "STRIPE_API_KEY",
        "STRIPE_WEBHOOK_SECRET",
    },
    f"{RELEASE}-gateway": {"DIPTYCH_INTERNAL_TOKEN", "REDIS_URL"},
    f"{RELEASE}-kv-tier": {"DIPTYCH_INTERNAL_TOKEN"},
    f"{RELEASE}-fleet-tiny-prefill": {"DIPTYCH_FLEET_TOKEN"},
    f"{RELEASE}-fleet-tiny-decode": {"DIPTYCH_FLEET_TOKEN"},
    f"{RELEASE}-migrate": {"DATABASE_URL", "DIPTYCH_SECRET_KEY"},
}


def test_secrets_are_scoped_per_component():
    objects = default_objects()
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in objects if d["kind"] == "Secret"}
    assert secrets == SCOPED_SECRETS
    used = {}
    for document, container in _containers(objects):
        names = {source["secretRef"]["name"] for source in container.get("envFrom", [])}
        names |= {
            v["valueFrom"]["secretKeyRef"]["name"]
            for v in container.get("env", [])
            if "secretKeyRef" in v.get("valueFrom", {})
        }
        used[document["metadata"]["name"]] = names
    assert used[f"{RELEASE}-gateway"] == {f"{RELEASE}-gateway"}
    assert used[f"{RELEASE}-tiny-prefill"] == {f"{RELEASE}-fleet-tiny-prefill"}
    assert used[f"{RELEASE}-tiny-decode"] == {f"{RELEASE}-fleet-tiny-decode"}
    assert used[f"{RELEASE}-kv-tier"] == {f"{RELEASE}-kv-tier"}


def test_the_usage_spool_is_on_a_persistent_volume_claim_per_gateway_replica():
    gateway = _by_name(default_objects(), "StatefulSet", f"{RELEASE}-gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    state_dir = container["args"][container["args"].index("--state-dir") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]
    claims = {claim["metadata"]["name"] for claim in gateway["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    assert mount["name"] not in {v["name"] for v in gateway["spec"]["template"]["spec"].get("volumes", [])}
    # The image's user (uid 10001) must be able to write to the claimed volume.
    assert gateway["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001


def _worker(objects, name: str) -> dict:
    (container,) = _by_name(objects, "Deployment", f"{RELEASE}-{name}")["spec"]["template"]["spec"]["containers"]
    return container


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_gpu_fleets_run_the_cuda_image_with_device_cuda_and_cpu_fleets_the_cpu_image():
    values = install_values()
    values["fleets"][1]["hardware"] = "cpu"  # tiny-decode on CPU nodes; tiny-prefill stays on GPUs
    objects = render(values)
    gpu, cpu = _worker(objects, "tiny-prefill"), _worker(objects, "tiny-decode")
    assert gpu["image"] == f"diptych:{values['image']['cudaTag']}" and _option(gpu["args"], "--device") == "cuda"
    assert gpu["resources"]["requests"]["nvidia.com/gpu"] == 1 and gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert cpu["image"] == f"diptych:{values['image']['tag']}" and _option(cpu["args"], "--device") == "cpu"
    assert "nvidia.com/gpu" not in cpu["resources"]["requests"] and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    cpu_pod = _by_name(objects, "Deployment", f"{RELEASE}-tiny-decode")["spec"]["template"]["spec"]
    assert "tolerations" not in cpu_pod


def test_each_fleet_gets_its_role_model_region_hardware_and_replicas():
    values = install_values()
    values["fleets"].append(
        {
            "name": "m100-colocated-eu",
            "role": "colocated",
            "model": "diptych-100m",
            "modelSource": "/models/diptych-100m",
            "region": "eu-west-1",
            "hardware": "cpu",
            "hardwareClass": "c7i",
            "replicas": 3,
            "maxReplicas": 0,
            "fleetToken": "dft_eu",
            "resources": {"requests": {"cpu": "8", "memory": "8Gi"}},
        }
    )
    objects = render(values)
    for document in objects:
        kubernetes_validate.validate(document, KUBERNETES_VERSIONS[-1], strict=True)
    deployment = _by_name(objects, "Deployment", f"{RELEASE}-m100-colocated-eu")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 3  # no autoscaler: maxReplicas 0
    assert not [d for d in objects if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"].endswith("-eu")]
    assert (_option(container["args"], "--role"), _option(container["args"], "--model")) == (
        "colocated",
        "diptych-100m",
    )
    assert _option(container["args"], "--model-source") == "/models/diptych-100m"
    assert pod["nodeSelector"] == {"topology.kubernetes.io/region": "eu-west-1", "diptych.dev/hardware-class": "c7i"}
    assert _by_name(objects, "Secret", f"{RELEASE}-fleet-m100-colocated-eu")["stringData"] == {
        "DIPTYCH_FLEET_TOKEN": "dft_eu"
    }
    # An autoscaled fleet leaves its replica count to the autoscaler, starting from `replicas`.
    autoscaled = _by_name(objects, "Deployment", f"{RELEASE}-tiny-decode")
    assert "replicas" not in autoscaled["spec"]
    hpa = _by_name(objects, "HorizontalPodAutoscaler", f"{RELEASE}-tiny-decode")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 16)


def test_workers_use_the_kv_tier_only_when_it_is_enabled():
    objects = default_objects()
    assert _option(_worker(objects, "tiny-decode")["args"], "--kv-tier") == f"{RELEASE}-kv-tier:50081"
    without = render(install_values(kvTier={"enabled": False}))
    assert "--kv-tier" not in _worker(without, "tiny-decode")["args"]
    assert not [d for d in without if d["metadata"]["name"].startswith(f"{RELEASE}-kv-tier")]
