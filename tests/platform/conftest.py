import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.catalog.models import Fleet, FleetRole, Model
from controlplane.catalog.services import fleet_ensure, fleet_token_rotate, model_ensure
from controlplane.tenancy.models import Organization
from controlplane.tenancy.services import IssuedApiKey, api_key_create, user_ensure
from diptych_common.internal_api.messages import UsageEvent

INTERNAL_TOKEN = "internal-token-for-tests"
ALL_SCOPES = ["inference", "admin:read", "admin:write"]


def bearer_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@dataclass(frozen=True)
class FleetWithToken:
    fleet: Fleet
    token: str


@pytest.fixture
def make_bearer_client() -> Callable[[str], APIClient]:
    return bearer_client


@pytest.fixture(autouse=True)
def fast_password_hashing(settings) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def cache_of_its_own(settings) -> None:
    """Each test counts its own failed sign-ins (every test client calls from 127.0.0.1): a key prefix of its own
    in the configured cache (Redis in CI, which is not flushed: other programs may share it)."""
    default = settings.CACHES["default"]
    settings.CACHES = {**settings.CACHES, "default": {**default, "KEY_PREFIX": f"test-{uuid.uuid4().hex}"}}


@pytest.fixture(autouse=True)
def internal_token(settings) -> str:
    settings.DIPTYCH_INTERNAL_TOKEN = INTERNAL_TOKEN
    return INTERNAL_TOKEN


@pytest.fixture
def internal_client() -> APIClient:
    return bearer_client(INTERNAL_TOKEN)


@pytest.fixture
def org_a(db) -> Organization:
    return Organization.objects.create(name="Acme", slug="acme")


@pytest.fixture
def org_b(db) -> Organization:
    return Organization.objects.create(name="Bravo", slug="bravo")


@pytest.fixture
def key_a(org_a) -> IssuedApiKey:
    return api_key_create(organization=org_a, name="acme-main", scopes=ALL_SCOPES)


@pytest.fixture
def key_b(org_b) -> IssuedApiKey:
    return api_key_create(organization=org_b, name="bravo-main", scopes=ALL_SCOPES)


@pytest.fixture
def client_a(key_a) -> APIClient:
    return bearer_client(key_a.key)


@pytest.fixture
def client_b(key_b) -> APIClient:
    return bearer_client(key_b.key)


@pytest.fixture
def tiny_model(db) -> Model:
    return model_ensure(
        name="diptych-tiny", source="builtin:diptych-tiny", context_length=1024, family="llama", dtype="float32"
    )


def make_fleet(model: Model, role: str, name: str) -> FleetWithToken:
    fleet = fleet_ensure(name=name, role=role, model=model, region="local", hardware_class="cpu")
    return FleetWithToken(fleet=fleet, token=fleet_token_rotate(fleet=fleet))


@pytest.fixture
def prefill_fleet(tiny_model) -> FleetWithToken:
    return make_fleet(tiny_model, FleetRole.PREFILL, "tiny-prefill")


@pytest.fixture
def decode_fleet(tiny_model) -> FleetWithToken:
    return make_fleet(tiny_model, FleetRole.DECODE, "tiny-decode")


@pytest.fixture
def prefill_client(prefill_fleet) -> APIClient:
    return bearer_client(prefill_fleet.token)


@pytest.fixture
def decode_client(decode_fleet) -> APIClient:
    return bearer_client(decode_fleet.token)


USAGE_STARTED_AT = timezone.now().replace(microsecond=123456) - timedelta(minutes=5)

# Midday in the middle of a month: far from every edge of a day and of a billing period (and no leap day).
MID_PERIOD = datetime(2026, 11, 18, 12, 0, tzinfo=UTC)


@pytest.fixture
def mid_period_clock(monkeypatch) -> datetime:
    """Runs the control plane's clock (django.utils.timezone.now, which its services and models read) from
    MID_PERIOD on, at the real pace: for a test whose usage lands "today", "a minute ago" or on "the period's
    first day", which must not see those fall together or apart with the day it is run on."""
    started = time.monotonic()
    monkeypatch.setattr(timezone, "now", lambda: MID_PERIOD + timedelta(seconds=time.monotonic() - started))
    return MID_PERIOD


def usage_event(issued_key: IssuedApiKey, request_id: str = "req-1", phase: str = "prefill", **overrides) -> dict:
    """A valid usage event as the gateway posts it, for `issued_key`'s organization."""
    event = UsageEvent(
        request_id=request_id,
        phase=phase,
        organization_id=issued_key.api_key.organization.public_id,
        api_key_id=issued_key.api_key.public_id,
        model="diptych-tiny",
        region="local",
        worker_id="wrk_prefill0",
        tokens=120,
        cached_tokens=64,
        kv_bytes=3 * 2**30,
        compute_ms=35,
        started_at=USAGE_STARTED_AT.isoformat(),
        finished_at=(USAGE_STARTED_AT + timedelta(milliseconds=40)).isoformat(),
    )
    return {**event.to_wire(), **overrides}


@pytest.fixture
def make_usage_event() -> Callable[..., dict]:
    return usage_event


@pytest.fixture
def usage_started_at():
    return USAGE_STARTED_AT


@pytest.fixture
def staff_user(db):
    return user_ensure(email="staff@diptych.local", password="staff-password-for-tests", is_staff=True)


@pytest.fixture
def staff_client(staff_user) -> APIClient:
    client = APIClient()
    client.force_login(staff_user)
    return client
