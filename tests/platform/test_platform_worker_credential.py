"""The worker RPC secret: registered workers and the gateway get the same one, nobody else gets it, and
it follows the control plane's secret key."""

import pytest

REGISTER_URL = "/api/v1/internal/workers/register"
CREDENTIAL_URL = "/api/v1/internal/worker-credential"


def registered_secret(client) -> str:
    response = client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "prefill-0"})
    assert response.status_code == 201, response.data
    return response.data["worker_rpc_secret"]


def test_workers_and_the_gateway_get_the_same_secret(prefill_client, internal_client):
    secret = registered_secret(prefill_client)
    response = internal_client.get(CREDENTIAL_URL)
    assert response.status_code == 200
    assert response.data == {"worker_rpc_secret": secret}
    assert len(secret) == 64  # 256 bits, hex


def test_the_secret_follows_the_secret_key(prefill_client, settings):
    first = registered_secret(prefill_client)
    settings.SECRET_KEY = "another deployment's secret key"
    assert registered_secret(prefill_client) != first


@pytest.mark.parametrize("caller", ["client_a", "prefill_client"])
def test_api_keys_and_fleet_tokens_cannot_read_the_gateways_copy(request, caller):
    response = request.getfixturevalue(caller).get(CREDENTIAL_URL)
    assert response.status_code == 401
    assert "worker_rpc_secret" not in response.data
