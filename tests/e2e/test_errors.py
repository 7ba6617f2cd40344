"""What a client sees for bad input and bad credentials: a precise status and a message that says what to change.

Each refusal is shown to be the gateway's: its request counter records the refusal under the status the
client got (a request the SDK itself refused never reaches it).
"""

import grpc
import httpx
import pytest

import diptych
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.waiting import wait_for

BAD_REQUESTS = [
    (dict(model="no-such-model", prompt="hi"), diptych.NotFoundError, "model 'no-such-model' does not exist"),
    (dict(model="diptych-tiny", prompt=""), diptych.BadRequestError, "prompt must not be empty"),
    (dict(model="diptych-tiny", prompt=[]), diptych.BadRequestError, "must not be empty"),
    (dict(model="diptych-tiny", prompt="hi", max_tokens=0), diptych.BadRequestError, "max_tokens must be at least 1"),
    (dict(model="diptych-tiny", prompt="hi", max_tokens=5000), diptych.BadRequestError, "lower max_tokens"),
    (dict(model="diptych-tiny", prompt=[7] * 1024), diptych.BadRequestError, "shorten the prompt"),
    (dict(model="diptych-tiny", prompt=[7, 9999]), diptych.BadRequestError, "outside the vocabulary"),
    (
        dict(model="diptych-tiny", prompt="hi", temperature=3.0),
        diptych.BadRequestError,
        "temperature must be between 0 and 2",
    ),
    (dict(model="diptych-tiny", prompt="hi", top_p=0.0), diptych.BadRequestError, "top_p must be greater than 0"),
    (dict(model="diptych-tiny", prompt="hi", stop=["a", "b", "c", "d", "e"]), diptych.BadRequestError, "at most 4"),
]


def gateway_requests(live, code: str | None = None) -> float:
    """Generate requests the split gateway has answered over gRPC, in all or with the status `code`."""
    text = httpx.get(live.metrics_urls["split"], timeout=5).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("diptych_gateway_requests_total{")
        and 'protocol="grpc"' in line
        and (code is None or f'code="{code}"' in line)
    )


@pytest.mark.parametrize(("params", "error", "message"), BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_bad_input_is_refused_by_the_gateway_with_a_precise_error(live, params, error, message):
    code = "NOT_FOUND" if error is diptych.NotFoundError else "INVALID_ARGUMENT"
    before = gateway_requests(live, code)
    with (
        diptych.Client(api_key=live.api_key, base_url=live.gateways["split"], max_retries=0) as client,
        pytest.raises(error) as raised,
    ):
        client.completions.create(**params)
    assert raised.value.code == code and message in raised.value.message
    assert gateway_requests(live, code) == before + 1, "the gateway did not record refusing it"


def test_a_negative_max_tokens_is_refused_by_the_sdk_before_it_is_sent(live):
    before = gateway_requests(live)
    with (
        diptych.Client(api_key=live.api_key, base_url=live.gateways["split"], max_retries=0) as client,
        pytest.raises(ValueError, match="-1"),
    ):
        client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=-1)
    assert gateway_requests(live) == before


def test_a_request_without_an_api_key_is_unauthenticated(live):
    target = live.gateways["split"].removeprefix("grpc://")
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(inference_pb2.GenerateRequest(model="diptych-tiny", prompt="hi"), timeout=10))
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in raised.value.details()


def test_a_wrong_api_key_is_unauthenticated(live):
    before = gateway_requests(live, "UNAUTHENTICATED")
    with (
        diptych.Client(api_key="dip_not-a-real-key", base_url=live.gateways["split"], max_retries=0) as client,
        pytest.raises(diptych.AuthenticationError),
    ):
        client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=2)
    assert gateway_requests(live, "UNAUTHENTICATED") == before + 1


def test_a_revoked_api_key_is_refused_by_the_gateway_and_the_rest_api(live):
    with live.rest() as rest:
        created = rest.post("/api-keys", json={"name": "short-lived"}).json()
    key = created["key"]
    with diptych.Client(api_key=key, base_url=live.gateways["split"], max_retries=0) as client:
        assert client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with live.rest() as rest:
            assert rest.post(f"/api-keys/{created['id']}/revoke").status_code == 200
        with live.rest(api_key=key) as rest:
            assert rest.get("/organization").status_code == 401

        def refused() -> bool:
            try:
                client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=1)
            except diptych.AuthenticationError:
                return True
            return False

        assert wait_for(refused, seconds=10, interval=0.25), "the revoked key still worked after 10 s"
