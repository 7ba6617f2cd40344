import pytest
from rest_framework.test import APIClient

GATEWAY_ENDPOINTS = [  # and the command line's: the internal token's
    ("get", "/api/v1/internal/registry"),
    ("post", "/api/v1/internal/api-keys/verify"),
    ("post", "/api/v1/internal/usage-events"),
    ("post", "/api/v1/internal/models/register"),
]
WORKER_ENDPOINTS = [
    ("post", "/api/v1/internal/workers/register"),
    ("post", "/api/v1/internal/workers/wrk_unknown/heartbeat"),
]


def _call(client: APIClient, method: str, url: str):
    return getattr(client, method)(url, {}, format="json") if method == "post" else client.get(url)


@pytest.mark.parametrize(("method", "url"), GATEWAY_ENDPOINTS + WORKER_ENDPOINTS)
def test_internal_endpoints_refuse_missing_and_wrong_tokens(db, make_bearer_client, internal_token, method, url):
    for client in [APIClient(), make_bearer_client("not-the-token"), make_bearer_client(internal_token + "x")]:
        response = _call(client, method, url)
        assert response.status_code == 401
        assert response.data["error"]["message"]


@pytest.mark.parametrize(("method", "url"), GATEWAY_ENDPOINTS)
def test_gateway_endpoints_refuse_api_keys_and_fleet_tokens(client_a, prefill_client, method, url):
    assert _call(client_a, method, url).status_code == 401
    assert _call(prefill_client, method, url).status_code == 401


@pytest.mark.parametrize(("method", "url"), WORKER_ENDPOINTS)
def test_worker_endpoints_refuse_api_keys_and_the_internal_token(client_a, internal_client, method, url):
    assert _call(client_a, method, url).status_code == 401
    assert _call(internal_client, method, url).status_code == 401


def test_internal_endpoints_refuse_everything_when_no_internal_token_is_configured(settings, db, make_bearer_client):
    settings.DIPTYCH_INTERNAL_TOKEN = ""
    for token in ["", "anything"]:
        response = make_bearer_client(token).get("/api/v1/internal/registry")
        assert response.status_code == 401


def test_internal_token_does_not_open_public_endpoints(internal_client):
    assert internal_client.get("/api/v1/organization").status_code == 401
