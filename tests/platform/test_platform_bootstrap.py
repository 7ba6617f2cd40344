import json
from io import StringIO

from django.core.management import call_command

from controlplane.catalog.models import Fleet, Model
from controlplane.tenancy.api_keys import looks_like_api_key
from controlplane.tenancy.models import ApiKey, Organization

REGISTER_URL = "/api/v1/internal/workers/register"
WORKER = {"address": "127.0.0.1:50061", "name": "worker-0"}


def bootstrap(*args: str) -> tuple[dict, str]:
    stdout, stderr = StringIO(), StringIO()
    call_command("bootstrap", "--json", *args, stdout=stdout, stderr=stderr)
    lines = stdout.getvalue().splitlines()
    assert len(lines) == 1, "stdout must hold exactly one JSON object"
    return json.loads(lines[0]), stderr.getvalue()


def test_bootstrap_creates_the_catalog_and_fleets(db):
    output, stderr = bootstrap()
    assert set(output) == {"fleet_tokens"}
    assert stderr
    model = Model.objects.get()
    assert (model.name, model.source, model.context_length, model.family, model.dtype) == (
        "diptych-tiny",
        "builtin:diptych-tiny",
        1024,
        "llama",
        "float32",
    )
    fleets = {fleet.name: fleet for fleet in Fleet.objects.select_related("model")}
    assert {name: fleet.role for name, fleet in fleets.items()} == {
        "tiny-prefill": "prefill",
        "tiny-decode": "decode",
        "tiny-colocated": "colocated",
    }
    assert all((f.model, f.region, f.hardware_class) == (model, "local", "cpu") for f in fleets.values())
    assert set(output["fleet_tokens"]) == {"prefill", "decode", "colocated"}
    assert all(token.startswith("dft_") for token in output["fleet_tokens"].values())


def test_fleet_tokens_work_for_their_own_fleet(db, make_bearer_client):
    output, _ = bootstrap()
    for role, token in output["fleet_tokens"].items():
        response = make_bearer_client(token).post(REGISTER_URL, WORKER)
        assert response.status_code == 201
        assert response.data["fleet"]["role"] == role


def test_bootstrap_is_idempotent_on_the_catalog_and_rotates_tokens(db, make_bearer_client):
    first, _ = bootstrap("--demo")
    second, _ = bootstrap("--demo")
    assert Model.objects.count() == 1
    assert Fleet.objects.count() == 3
    assert Organization.objects.count() == 1
    assert first["organization_id"] == second["organization_id"]
    for role in ("prefill", "decode", "colocated"):
        assert first["fleet_tokens"][role] != second["fleet_tokens"][role]
        old = make_bearer_client(first["fleet_tokens"][role]).post(REGISTER_URL, WORKER)
        new = make_bearer_client(second["fleet_tokens"][role]).post(REGISTER_URL, WORKER)
        assert (old.status_code, new.status_code) == (401, 201)


def test_demo_creates_the_demo_organization_and_a_new_key_each_run(db, internal_client):
    first, _ = bootstrap("--demo")
    second, _ = bootstrap("--demo")
    organization = Organization.objects.get(slug="demo")
    assert organization.name == "Demo"
    assert first["organization_id"] == organization.public_id
    assert looks_like_api_key(first["api_key"]) and looks_like_api_key(second["api_key"])
    assert first["api_key"] != second["api_key"]
    assert ApiKey.objects.filter(organization=organization, name="demo").count() == 2
    verified = internal_client.post("/api/v1/internal/api-keys/verify", {"api_key": second["api_key"]})
    assert verified.data["organization_id"] == organization.public_id


def test_bootstrap_model_overrides(db, tmp_path):
    output, _ = bootstrap("--model", "qwen2-0.5b", "--source", str(tmp_path), "--context-length", "4096")
    model = Model.objects.get(name="qwen2-0.5b")
    assert (model.source, model.context_length) == (str(tmp_path), 4096)
    assert set(Fleet.objects.values_list("name", flat=True)) == {
        "qwen2-0.5b-prefill",
        "qwen2-0.5b-decode",
        "qwen2-0.5b-colocated",
    }
    assert set(output["fleet_tokens"]) == {"prefill", "decode", "colocated"}
