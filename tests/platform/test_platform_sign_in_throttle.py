"""Sign-ins are throttled per client address: past DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE failed ones (a wrong
password at auth/login, a wrong token or password at auth/accept-invitation), every sign-in from that address
answers 429 in the API's error shape, with Retry-After, until the oldest failure is a minute old. Sign-ins
that succeed are not counted."""

import pytest
from rest_framework.test import APIClient

from controlplane.common.throttles import SignInFailureThrottle
from controlplane.tenancy.services import member_add

LOGIN_URL = "/api/v1/auth/login"
ACCEPT_URL = "/api/v1/auth/accept-invitation"
EMAIL = "owner@acme.test"
PASSWORD = "correct-horse-battery-staple"


@pytest.fixture
def member(org_a):
    return member_add(organization=org_a, email=EMAIL, role="owner", password=PASSWORD)


@pytest.fixture
def allowed(settings) -> int:
    return settings.DIPTYCH_SIGN_IN_FAILURES_PER_MINUTE


def sign_in(client: APIClient, password: str, **headers):
    return client.post(LOGIN_URL, {"email": EMAIL, "password": password}, format="json", **headers)


def fail_to_sign_in(client: APIClient, times: int, **headers) -> None:
    assert [sign_in(client, "not-the-password", **headers).status_code for _ in range(times)] == [401] * times


def test_the_failure_past_the_limit_is_a_429_with_retry_after_and_so_is_the_right_password(member, allowed):
    client = APIClient()
    fail_to_sign_in(client, allowed)

    refused = sign_in(client, "not-the-password")
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "throttled"
    assert "throttled" in refused.json()["error"]["message"]
    assert 1 <= int(refused["Retry-After"]) <= 60
    right_password = sign_in(client, PASSWORD)
    assert right_password.status_code == 429  # the guesser learns nothing more
    assert "sessionid" not in right_password.cookies


def test_sign_ins_are_allowed_again_once_the_failures_are_a_minute_old(member, allowed, monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(SignInFailureThrottle, "timer", lambda self: now[0])
    client = APIClient()
    fail_to_sign_in(client, allowed)
    now[0] += 59
    assert sign_in(client, PASSWORD).status_code == 429
    now[0] += 1
    assert sign_in(client, PASSWORD).status_code == 200


def test_successful_sign_ins_are_not_counted(member, allowed):
    client = APIClient()
    assert {sign_in(client, PASSWORD).status_code for _ in range(allowed + 2)} == {200}
    fail_to_sign_in(client, allowed)


def test_another_address_is_not_throttled(member, allowed):
    client = APIClient()
    fail_to_sign_in(client, allowed)
    assert sign_in(client, PASSWORD, REMOTE_ADDR="198.51.100.2").status_code == 200


def test_a_client_cannot_choose_its_address_with_x_forwarded_for(member, allowed):
    client = APIClient()
    fail_to_sign_in(client, allowed)
    assert sign_in(client, PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.7").status_code == 429


def test_behind_trusted_proxies_the_address_they_saw_is_counted(member, allowed, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
    client = APIClient()
    fail_to_sign_in(client, allowed, HTTP_X_FORWARDED_FOR="203.0.113.7")
    assert sign_in(client, PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.7").status_code == 429
    assert sign_in(client, PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.8").status_code == 200


def test_failed_invitation_acceptances_count_as_failed_sign_ins(member, allowed):
    client = APIClient()
    bad_tokens = [
        client.post(ACCEPT_URL, {"token": f"inv_{index:038d}", "password": PASSWORD}, format="json").status_code
        for index in range(allowed)
    ]
    assert bad_tokens == [401] * allowed
    assert sign_in(client, PASSWORD).status_code == 429
    throttled = client.post(ACCEPT_URL, {"token": "inv_" + "0" * 38, "password": PASSWORD}, format="json")
    assert throttled.status_code == 429 and throttled.json()["error"]["type"] == "throttled"
