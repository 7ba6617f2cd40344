"""What a client sees for bad input and bad credentials: a precise status and a message that says what to change."""

import diptych
import grpc
import pytest

from diptych._proto.v1 import inference_pb2, inference_pb2_grpc

BAD_REQUESTS = [
    (dict(model="no-such-model", prompt="hi"), diptych.NotFoundError, "model 'no-such-model' does not exist"),
    (dict(model="diptych-tiny", prompt=""), diptych.BadRequestError, "prompt must not be empty"),
    (dict(model="diptych-tiny", prompt=[]), diptych.BadRequestError, "must not be empty"),
    (dict(model="diptych-tiny", prompt="hi", max_tokens=0), diptych.BadRequestError, "max_tokens must be at least 1"),
    (dict(model="diptych-tiny", prompt="hi", max_tokens=5000), diptych.BadRequestError, "lower max_tokens"),
    (dict(model="diptych-tiny", prompt=[7] * 1024), diptych.BadRequestError, "shorten the prompt"),
    (dict(model="diptych-tiny", prompt=[7, 9999]), diptych.BadRequestError, "outside the vocabulary"),
    (dict(model="diptych-tiny", prompt="hi", temperature=3.0), diptych.BadRequestError, "temperature must be between 0 and 2"),
    (dict(model="diptych-tiny", prompt="hi", top_p=0.0), diptych.BadRequestError, "top_p must be greater than 0"),
    (dict(model="diptych-tiny", prompt="hi", stop=["a", "b", "c", "d", "e"]), diptych.BadRequestError, "at most 4"),
]


@pytest.mark.parametrize(("params", "error", "message"), BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_bad_input_is_refused_with_a_precise_error(live, params, error, message):
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"], max_retries=0) as client:
        with pytest.raises(error) as raised:
            client.completions.create(**params)
    assert message in raised.value.message


def test_a_negative_max_tokens_is_refused_by_the_sdk_or_the_gateway(live):
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"], max_retries=0) as client:
        with pytest.raises((diptych.BadRequestError, ValueError)):
            client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=-1)


def test_a_request_without_an_api_key_is_unauthenticated(live):
    target = live.gateways["split"].removeprefix("grpc://")
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(inference_pb2.GenerateRequest(model="diptych-tiny", prompt="hi"), timeout=10))
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in raised.value.details()


def test_a_wrong_api_key_is_unauthenticated(live):
    with diptych.Client(api_key="dip_not-a-real-key", base_url=live.gateways["split"], max_retries=0) as client:
        with pytest.raises(diptych.AuthenticationError):
            client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=2)


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
        _wait_until_refused(client, seconds=10)


def _wait_until_refused(client, seconds: float) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client.completions.create(model="diptych-tiny", prompt="hi", max_tokens=1)
        except diptych.AuthenticationError:
            return
        time.sleep(0.25)
    pytest.fail(f"the revoked key still worked after {seconds} s")
