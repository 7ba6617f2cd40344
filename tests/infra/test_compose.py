"""infra/compose.yaml starts the whole platform on a first `docker compose up` and again on every later one:
the file is valid, every Diptych service waits for bootstrap, bootstrap keeps the credentials it issued on a
volume and reuses them while they work, and the entrypoint hands them to each service."""

import json
import os
import shutil
import stat
import subprocess
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.catalog.models import Fleet
from controlplane.catalog.services import fleet_token_rotate

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "infra" / "compose.yaml"
WITH_CREDENTIALS = REPO / "infra" / "docker" / "with-credentials"
REGISTER_URL = "/api/v1/internal/workers/register"


def _compose_binary() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(
    _compose_binary() is None,
    reason="needs `docker compose` or `docker-compose`: apt-get install -y docker-compose",
)
def test_docker_compose_config_passes_with_nothing_set_in_the_environment():
    # Only PATH: a first `up` must need no variable set by hand (no ${VAR:?...} left to fill in).
    result = subprocess.run(
        [*_compose_binary(), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        cwd=COMPOSE.parent,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert {"bootstrap", "control-plane", "jobs", "kv-tier", "prefill", "decode", "gateway"} <= set(config["services"])


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _waits_for(services: dict, service: str, other: str, condition: str) -> bool:
    """Whether `service` starts only once `other` has reached `condition`, directly or through what it waits for."""
    depends_on = services[service].get("depends_on", {})
    if isinstance(depends_on, list):
        depends_on = {name: {"condition": "service_started"} for name in depends_on}
    if depends_on.get(other, {}).get("condition") == condition:
        return True
    return any(_waits_for(services, name, other, condition) for name in depends_on)


def test_every_diptych_service_starts_after_bootstrap_has_finished():
    services = _services()
    diptych = [name for name, definition in services.items() if definition.get("image", "").startswith("diptych")]
    for name in diptych:
        if name != "bootstrap":
            assert _waits_for(services, name, "bootstrap", "service_completed_successfully"), name
    for name in ("gateway", "prefill", "decode", "kv-tier"):
        assert _waits_for(services, name, "control-plane", "service_healthy"), name
    assert "healthcheck" in services["control-plane"]
    assert services["bootstrap"]["restart"] == "no"


def test_the_jobs_service_is_health_checked_by_asking_its_own_celery_node():
    """Celery serves no port, so a wedged jobs process looked healthy to compose: it asks its own node."""
    check = " ".join(_services()["jobs"]["healthcheck"]["test"])
    assert "celery -A controlplane.celery inspect ping" in check and "celery@$$(hostname)" in check  # $$: compose's $


def test_only_bootstrap_may_write_the_credentials_and_every_diptych_service_reads_them():
    for name, definition in _services().items():
        if not definition.get("image", "").startswith("diptych"):
            continue
        assert definition["entrypoint"] == ["with-credentials"], name
        (mount,) = [v for v in definition["volumes"] if v.startswith("credentials:")]
        assert mount.endswith(":ro") == (name != "bootstrap"), name


def test_no_image_is_latest():
    for name, definition in _services().items():
        image = definition["image"]
        assert ":" in image and not image.endswith(":latest"), f"compose:{name} runs {image}"


# ---- the entrypoint: secrets made once, then reused; a worker gets its own fleet's token ----


def _run_entrypoint(state_dir: Path, *command: str, **env: str) -> str:
    result = subprocess.run(
        ["sh", str(WITH_CREDENTIALS), *command],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "DIPTYCH_STATE_DIR": str(state_dir), **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _printed_env(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if line.startswith("DIPTYCH_"))


@pytest.fixture
def credentials_dir(tmp_path) -> Path:
    (tmp_path / "credentials").mkdir()
    return tmp_path / "credentials"


def test_the_entrypoint_makes_the_shared_secrets_once_and_reuses_them(credentials_dir):
    first = _printed_env(_run_entrypoint(credentials_dir.parent, "env"))
    second = _printed_env(_run_entrypoint(credentials_dir.parent, "env"))
    assert len(first["DIPTYCH_SECRET_KEY"]) >= 50 and len(first["DIPTYCH_INTERNAL_TOKEN"]) >= 32
    assert (first["DIPTYCH_SECRET_KEY"], first["DIPTYCH_INTERNAL_TOKEN"]) == (
        second["DIPTYCH_SECRET_KEY"],
        second["DIPTYCH_INTERNAL_TOKEN"],
    )
    assert stat.S_IMODE((credentials_dir / "secrets.env").stat().st_mode) == 0o600
    assert "DIPTYCH_FLEET_TOKEN" not in first  # not a worker
    # What the environment sets wins over what is kept.
    chosen = _printed_env(_run_entrypoint(credentials_dir.parent, "env", DIPTYCH_INTERNAL_TOKEN="chosen"))
    assert chosen["DIPTYCH_INTERNAL_TOKEN"] == "chosen"


def test_the_entrypoint_gives_a_worker_the_token_of_its_role(credentials_dir):
    (credentials_dir / "bootstrap.json").write_text(
        json.dumps({"fleet_tokens": {"prefill": "dft_p", "decode": "dft_d"}})
    )
    # A `diptych` that prints its environment stands in for the program; the entrypoint reads the role from
    # the `diptych worker` command line.
    shim = credentials_dir.parent / "bin"
    shim.mkdir()
    (shim / "diptych").write_text("#!/bin/sh\nexec env\n")
    (shim / "diptych").chmod(0o755)
    output = _run_entrypoint(
        credentials_dir.parent, "diptych", "worker", "--role", "decode", PATH=f"{shim}:{os.environ['PATH']}"
    )
    assert _printed_env(output)["DIPTYCH_FLEET_TOKEN"] == "dft_d"


# ---- bootstrap --credentials-file: what compose's bootstrap runs on every `up` ----


def _bootstrap(path: Path) -> dict:
    stdout = StringIO()
    call_command("bootstrap", "--json", "--demo", "--credentials-file", str(path), stdout=stdout, stderr=StringIO())
    return json.loads(stdout.getvalue())


def _registers(token: str) -> int:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post(REGISTER_URL, {"address": "10.0.0.7:50061", "name": "worker-0"}).status_code


def _signs_in(password: str) -> int:
    return APIClient().post("/api/v1/auth/login", {"email": "demo@diptych.local", "password": password}).status_code


def test_bootstrap_reuses_the_credentials_it_kept_while_they_work(db, tmp_path):
    path = tmp_path / "bootstrap.json"
    first = _bootstrap(path)
    assert json.loads(path.read_text()) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = _bootstrap(path)
    assert second == first  # a second `up` changes nothing: the running workers' tokens keep working
    for token in first["fleet_tokens"].values():
        assert _registers(token) == 201
    assert _signs_in(first["dashboard_password"]) == 200
    models = APIClient()
    models.credentials(HTTP_AUTHORIZATION=f"Bearer {first['api_key']}")
    assert models.get("/api/v1/models").status_code == 200


def test_bootstrap_replaces_only_the_credentials_that_stopped_working(db, tmp_path):
    path = tmp_path / "bootstrap.json"
    first = _bootstrap(path)
    fleet_token_rotate(fleet=Fleet.objects.get(name="tiny-decode"))  # an operator rotated it by hand
    second = _bootstrap(path)
    assert second["fleet_tokens"]["decode"] != first["fleet_tokens"]["decode"]
    assert _registers(second["fleet_tokens"]["decode"]) == 201
    assert {r: t for r, t in second["fleet_tokens"].items() if r != "decode"} == {
        r: t for r, t in first["fleet_tokens"].items() if r != "decode"
    }
    assert (second["api_key"], second["dashboard_password"]) == (first["api_key"], first["dashboard_password"])


def test_bootstrap_issues_new_credentials_for_a_fresh_database(db, tmp_path):
    path = tmp_path / "bootstrap.json"
    path.write_text(json.dumps({"fleet_tokens": {"prefill": "dft_from_another_database"}, "api_key": "dip_x"}))
    output = _bootstrap(path)
    assert output["fleet_tokens"]["prefill"] != "dft_from_another_database" and output["api_key"] != "dip_x"
    assert _registers(output["fleet_tokens"]["prefill"]) == 201


@pytest.mark.parametrize("content", ["not json", "[1, 2]"])
def test_bootstrap_refuses_a_credentials_file_it_did_not_write(db, tmp_path, content):
    path = tmp_path / "bootstrap.json"
    path.write_text(content)
    with pytest.raises(CommandError, match=r"--credentials-file .* is not a JSON object bootstrap wrote"):
        _bootstrap(path)
    assert path.read_text() == content
