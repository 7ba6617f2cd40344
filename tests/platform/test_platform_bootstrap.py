import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.catalog.models import Fleet, Model, Price
from controlplane.tenancy.api_keys import looks_like_api_key
from controlplane.tenancy.models import ApiKey, Membership, Organization
from diptych_server.stack import bootstrap_arguments

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


def test_demo_creates_the_dashboard_owner_with_a_fresh_password(db):
    first, _ = bootstrap("--demo")
    second, _ = bootstrap("--demo")
    assert first["dashboard_email"] == "demo@diptych.local"
    assert first["dashboard_password"] != second["dashboard_password"]
    client = APIClient()
    old = client.post("/api/v1/auth/login", {"email": "demo@diptych.local", "password": first["dashboard_password"]})
    assert old.status_code == 401
    login = client.post("/api/v1/auth/login", {"email": "demo@diptych.local", "password": second["dashboard_password"]})
    assert login.status_code == 200
    assert login.data["user"]["role"] == "owner"
    assert login.data["user"]["organization"]["id"] == second["organization_id"]
    assert Membership.objects.count() == 1


def test_demo_key_has_every_scope(db, internal_client):
    output, _ = bootstrap("--demo")
    verified = internal_client.post("/api/v1/internal/api-keys/verify", {"api_key": output["api_key"]})
    assert verified.data["scopes"] == ["inference", "admin:read", "admin:write"]


def test_the_demo_organization_has_the_default_rate_limits_for_the_gateway_to_show(db, internal_client):
    output, _ = bootstrap("--demo")
    verified = internal_client.post("/api/v1/internal/api-keys/verify", {"api_key": output["api_key"]})
    assert verified.data["limits"]["organization"] == {
        "requests_per_minute": 500,
        "input_tokens_per_minute": 200_000,
        "output_tokens_per_minute": 200_000,
    }


def test_staff_user_from_bootstrap_sees_fleets(db):
    output, _ = bootstrap("--staff-email", "ops@diptych.local", "--staff-password", "ops-password-123")
    assert output["staff_email"] == "ops@diptych.local"
    client = APIClient()
    login = client.post("/api/v1/auth/login", {"email": "ops@diptych.local", "password": "ops-password-123"})
    assert login.data["user"]["is_staff"]
    assert client.get("/api/v1/fleets").data["total"] == 3


def test_staff_email_needs_a_password(db):
    with pytest.raises(CommandError):
        bootstrap("--staff-email", "ops@diptych.local")


def test_bootstrap_seeds_prices_once(db):
    bootstrap()
    bootstrap("--model", "diptych-100m")
    prices = {(p.model.name, p.phase, p.tier): p.micros_per_million for p in Price.objects.select_related("model")}
    standard = {
        ("diptych-tiny", "prefill"): 100_000,
        ("diptych-tiny", "cached_prefill"): 25_000,
        ("diptych-tiny", "decode"): 400_000,
        ("diptych-100m", "prefill"): 200_000,
        ("diptych-100m", "cached_prefill"): 50_000,
        ("diptych-100m", "decode"): 800_000,
    }
    batch_at_half_price = {(model, phase, "batch"): micros // 2 for (model, phase), micros in standard.items()}
    assert prices == {(model, phase, "standard"): micros for (model, phase), micros in standard.items()} | (
        batch_at_half_price
    )
    bootstrap()
    assert Price.objects.count() == 12


def test_up_s_staff_password_may_start_with_a_dash(db):
    """`diptych up` makes the staff password with token_urlsafe, which may start with '-'."""
    stdout = StringIO()
    call_command("bootstrap", *bootstrap_arguments(True, "staff@diptych.local", "-dash-first-123"), stdout=stdout)
    assert json.loads(stdout.getvalue())["staff_email"] == "staff@diptych.local"
    login = APIClient().post("/api/v1/auth/login", {"email": "staff@diptych.local", "password": "-dash-first-123"})
    assert login.data["user"]["is_staff"]


def test_each_region_and_hardware_class_gets_fleets_of_its_own(db, make_bearer_client):
    local, _ = bootstrap()
    west, stderr = bootstrap("--region", "west")
    gpu, _ = bootstrap("--region", "us-east-1", "--hardware-class", "h100")
    fleets = {f.name: (f.role, f.region, f.hardware_class) for f in Fleet.objects.all()}
    assert fleets == {
        **{f"tiny-{role}": (role, "local", "cpu") for role in ("prefill", "decode", "colocated")},
        **{f"tiny-{role}-west": (role, "west", "cpu") for role in ("prefill", "decode", "colocated")},
        **{f"tiny-{role}-us-east-1-h100": (role, "us-east-1", "h100") for role in ("prefill", "decode", "colocated")},
    }
    assert "west cpu fleets are ready" in stderr
    registered = make_bearer_client(west["fleet_tokens"]["decode"]).post(REGISTER_URL, WORKER)
    assert (registered.data["fleet"]["name"], registered.data["fleet"]["region"]) == ("tiny-decode-west", "west")
    # Each run rotates only its own region's tokens: the local ones still work.
    again = make_bearer_client(local["fleet_tokens"]["prefill"]).post(REGISTER_URL, WORKER)
    assert again.status_code == 201 and again.data["fleet"]["region"] == "local"
    assert make_bearer_client(gpu["fleet_tokens"]["colocated"]).post(REGISTER_URL, WORKER).status_code == 201


@pytest.mark.parametrize("option", ["--region", "--hardware-class"])
@pytest.mark.parametrize("value", ["", "two words", "-dash-first", "x" * 65])
def test_a_bad_region_or_hardware_class_is_refused_and_changes_nothing(db, option, value):
    with pytest.raises(CommandError, match=f"{option} .* must be 1 to 64 letters"):
        bootstrap(f"{option}={value}")
    assert not Fleet.objects.exists() and not Model.objects.exists()
