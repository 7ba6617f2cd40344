"""The chart's model-artifact settings: each worker gets a cache volume for published model files; a fleet
without a modelSource loads its model as the catalog has it; an S3 store reaches the control plane (which
describes it) and the workers (which read it), with its credentials in a Secret of their own."""

import kubernetes_validate
import pytest

from tests.infra.chart import RELEASE, default_objects, install_values, render

CACHE = "/var/cache/diptych/artifacts"
S3 = {"store": "s3://models/published", "s3Endpoint": "http://minio.storage:9000", "s3Region": "eu-west-1"}


def _deployment(objects, name: str) -> dict:
    (found,) = [d for d in objects if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-{name}"]
    return found


def _container(objects, name: str) -> dict:
    return _deployment(objects, name)["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _secret_refs(container: dict) -> set[str]:
    return {source["secretRef"]["name"] for source in container.get("envFrom", [])}


def test_every_worker_fetches_into_a_bounded_cache_volume_of_its_own():
    objects = default_objects()
    for fleet in ("tiny-prefill", "tiny-decode"):
        deployment = _deployment(objects, fleet)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--artifact-cache") + 1] == CACHE
        assert {"name": "artifact-cache", "mountPath": CACHE} in container["volumeMounts"]
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["artifact-cache"] == {"name": "artifact-cache", "emptyDir": {"sizeLimit": "50Gi"}}


def test_a_fleet_without_a_model_source_asks_the_catalog_and_one_with_it_loads_it():
    values = install_values()
    values["fleets"][0]["modelSource"] = ""
    objects = render(values)
    catalog, explicit = _container(objects, "tiny-prefill")["args"], _container(objects, "tiny-decode")["args"]
    assert "--model-source" not in catalog
    assert catalog[catalog.index("--model") + 1] == "diptych-tiny"  # the worker checks it against the manifest
    assert explicit[explicit.index("--model-source") + 1] == "builtin:diptych-tiny"


def test_the_default_install_has_no_store_settings_or_credentials():
    objects = default_objects()
    assert not [d for d in objects if d["kind"] == "Secret" and d["metadata"]["name"].endswith("artifact-store")]
    assert _env(_container(objects, "control-plane"))["DIPTYCH_ARTIFACT_STORE"] == ""


@pytest.mark.parametrize("version", ["1.27.0", kubernetes_validate.latest_version()])
def test_an_s3_store_reaches_the_control_plane_and_the_workers_with_its_credentials(version):
    values = install_values(artifacts=S3 | {"cacheSizeLimit": "20Gi"})
    values["secrets"].update(awsAccessKeyId="AKIAEXAMPLE", awsSecretAccessKey="secret-example")
    objects = render(values)
    (secret,) = [d for d in objects if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-artifact-store"]
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret-example"}

    control_plane = _container(objects, "control-plane")
    store_env = ("DIPTYCH_ARTIFACT_STORE", "DIPTYCH_ARTIFACT_S3_ENDPOINT", "AWS_DEFAULT_REGION")
    assert [_env(control_plane)[name] for name in store_env] == [S3["store"], S3["s3Endpoint"], "eu-west-1"]
    assert f"{RELEASE}-artifact-store" in _secret_refs(control_plane)
    for fleet in ("tiny-prefill", "tiny-decode"):
        worker = _container(objects, fleet)
        assert _env(worker)["AWS_DEFAULT_REGION"] == "eu-west-1"
        assert _secret_refs(worker) == {f"{RELEASE}-fleet-{fleet}", f"{RELEASE}-artifact-store"}
        volumes = _deployment(objects, fleet)["spec"]["template"]["spec"]["volumes"]
        assert {"name": "artifact-cache", "emptyDir": {"sizeLimit": "20Gi"}} in volumes
    for document in objects:
        kubernetes_validate.validate(document, version, strict=True)


def test_an_access_key_without_its_secret_key_fails_naming_it():
    values = install_values(artifacts=S3)
    values["secrets"].update(awsAccessKeyId="AKIAEXAMPLE")
    with pytest.raises(Exception, match=r"secrets.awsSecretAccessKey"):
        render(values)
