"""Every pod the chart makes runs as the image's user, never as root, with the runtime's seccomp profile, and
every container on a read-only root filesystem without privilege escalation or capabilities, given volumes
for what its process writes: /tmp, the user's HOME and, where the process keeps state, DIPTYCH_STATE_DIR."""

from tests.infra.chart import RELEASE, default_objects, install_values, render
from tests.infra.test_dockerfile import image_user

WORKLOADS = {"Deployment", "StatefulSet", "Job"}
# The processes that write under DIPTYCH_STATE_DIR: published model files without an S3 store, Celery beat's
# schedule, the gateway's usage spool.
KEEP_STATE = {"control-plane", "jobs", "gateway"}


def _pods(objects) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in objects if d["kind"] in WORKLOADS}


def _writable_mounts(pod: dict, container: dict) -> set[str]:
    """The paths mounted writable from an emptyDir or a PersistentVolumeClaim (the StatefulSet's claims are not
    among the pod's volumes)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    writable = set()
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if not mount.get("readOnly") and (volume is None or "emptyDir" in volume):
            writable.add(mount["mountPath"])
    return writable


def _check(objects) -> set[str]:
    user = image_user()
    pods = _pods(objects)
    for name, pod in pods.items():
        assert pod.get("securityContext", {}) == {
            "runAsNonRoot": True,
            "runAsUser": user.uid,
            "runAsGroup": user.gid,
            "fsGroup": user.gid,
            "seccompProfile": {"type": "RuntimeDefault"},
        }, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{container['name']}"
            context = container.get("securityContext", {})
            assert context.get("readOnlyRootFilesystem") is True, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("capabilities") == {"drop": ["ALL"]}, where
            assert context.get("runAsNonRoot", True) is True and context.get("runAsUser", user.uid) == user.uid, where
            assert not context.get("privileged"), where
            assert context.get("seccompProfile", {"type": "RuntimeDefault"}) == {"type": "RuntimeDefault"}, where
            writable = _writable_mounts(pod, container)
            assert {"/tmp", user.home} <= writable, f"{where}: writable {sorted(writable)}"
            if container["name"] in KEEP_STATE:
                assert user.state_dir in writable, f"{where}: {user.state_dir} is not writable"
    return set(pods)


def test_every_container_runs_as_the_image_s_user_on_a_read_only_root_with_what_it_writes_on_volumes():
    checked = _check(default_objects())
    fleets = {f"{RELEASE}-{fleet['name']}" for fleet in install_values()["fleets"]}
    parts = {f"{RELEASE}-{part}" for part in ("control-plane", "jobs", "gateway", "kv-tier", "migrate")}
    assert checked == parts | fleets


def test_a_cpu_colocated_fleet_and_an_s3_store_keep_the_same_restrictions():
    values = install_values()
    values["artifacts"] |= {"store": "s3://models/published", "s3Region": "eu-west-1"}
    values["secrets"].update(awsAccessKeyId="AKIA", awsSecretAccessKey="secret")
    values["fleets"].append({**values["fleets"][0], "name": "cpu-colocated", "role": "colocated", "hardware": "cpu"})
    values["fleets"][-1]["region"] = "eu-west-1"
    assert f"{RELEASE}-cpu-colocated" in _check(render(values))


def _service_accounts(objects) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in objects if d["kind"] == "ServiceAccount"}


def _check_identities(objects) -> None:
    """Each workload's pods run on a ServiceAccount of their own, named as the workload, and neither the pod nor
    the account mounts an API token: no Diptych process calls the Kubernetes API."""
    accounts = _service_accounts(objects)
    pods = _pods(objects)
    assert set(accounts) == set(pods), "a ServiceAccount per workload, and none besides"
    for name, pod in pods.items():
        assert pod.get("serviceAccountName") == name, f"{name} runs on {pod.get('serviceAccountName', 'default')}"
        assert pod.get("automountServiceAccountToken") is False, name
        assert accounts[name].get("automountServiceAccountToken") is False, name


def test_every_workload_runs_on_a_service_account_of_its_own_without_an_api_token():
    objects = default_objects()
    _check_identities(objects)
    without_tier = render(install_values(kvTier={"enabled": False}))
    _check_identities(without_tier)
    assert f"{RELEASE}-kv-tier" not in _service_accounts(without_tier)


def test_the_migrations_job_s_service_account_exists_before_the_hook_job_runs():
    """Hooks run before the release's other objects exist: the Job's account is a hook that runs first."""
    objects = default_objects()
    (job,) = [d for d in objects if d["kind"] == "Job"]
    account = _service_accounts(objects)[job["spec"]["template"]["spec"]["serviceAccountName"]]
    assert account["metadata"]["annotations"]["helm.sh/hook"] == job["metadata"]["annotations"]["helm.sh/hook"]
    weight = int(account["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert weight < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])


def test_service_account_annotations_reach_every_long_running_workload_s_account():
    """e.g. the cloud role that reads the S3 artifact store (IRSA's eks.amazonaws.com/role-arn)."""
    role = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/diptych"}
    objects = render(install_values(serviceAccount={"annotations": role}))
    annotated = {
        name for name, account in _service_accounts(objects).items() if account["metadata"].get("annotations") == role
    }
    long_running = {
        name for name in _pods(objects) if not name.endswith("-migrate")
    }  # migrations read only the database
    assert annotated == long_running
