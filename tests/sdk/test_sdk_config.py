from __future__ import annotations

import pytest

import diptych
from diptych._transport import Endpoint, parse_base_url, parse_base_urls


def test_missing_api_key_fails_at_construction():
    with pytest.raises(diptych.AuthenticationError, match="DIPTYCH_API_KEY"):
        diptych.Client()
    with pytest.raises(diptych.AuthenticationError, match="api_key client option must be set"):
        diptych.AsyncClient(api_key="")


def test_configuration_from_environment(monkeypatch):
    monkeypatch.setenv("DIPTYCH_API_KEY", "env-key")
    monkeypatch.setenv("DIPTYCH_BASE_URL", "grpcs://api.example.com:8443")
    monkeypatch.setenv("DIPTYCH_ADMIN_URL", "https://admin.example.com/")
    with diptych.Client() as client:
        assert client.admin_url == "https://admin.example.com"
        assert client.api_key == "env-key"
        assert client.base_url == "grpcs://api.example.com:8443"
        assert client._endpoints == [Endpoint("api.example.com:8443", secure=True)]
        assert client._metadata == (("authorization", "Bearer env-key"),)
        assert (client.timeout, client.max_retries, client.stream_idle_timeout) == (600.0, 2, 60.0)


def test_arguments_take_precedence_over_environment(monkeypatch):
    monkeypatch.setenv("DIPTYCH_API_KEY", "env-key")
    monkeypatch.setenv("DIPTYCH_BASE_URL", "grpcs://api.example.com")
    with diptych.Client(api_key="arg-key", base_url="localhost:7000", timeout=5, max_retries=0) as client:
        assert client.api_key == "arg-key"
        assert client._endpoints == [Endpoint("localhost:7000", secure=False)]
        assert (client.timeout, client.max_retries) == (5, 0)


def test_default_base_url():
    with diptych.Client(api_key="k") as client:
        assert client.admin_url == "http://127.0.0.1:8000"
        assert client.base_url == "grpc://127.0.0.1:50051"
        assert client._endpoints == [Endpoint("127.0.0.1:50051", secure=False)]


@pytest.mark.parametrize(
    ("base_url", "expected"),
    [
        ("grpc://gateway:50051", Endpoint("gateway:50051", secure=False)),
        ("grpcs://api.example.com:443", Endpoint("api.example.com:443", secure=True)),
        ("GRPCS://api.example.com", Endpoint("api.example.com:443", secure=True)),
        ("grpc://gateway", Endpoint("gateway:50051", secure=False)),
        ("gateway:9000", Endpoint("gateway:9000", secure=False)),
        ("10.0.0.7:50051", Endpoint("10.0.0.7:50051", secure=False)),
        ("grpc://[::1]:50051", Endpoint("[::1]:50051", secure=False)),
        ("[::1]:50051", Endpoint("[::1]:50051", secure=False)),
        ("grpcs://api.example.com/", Endpoint("api.example.com:443", secure=True)),
    ],
)
def test_parse_base_url(base_url, expected):
    assert parse_base_url(base_url) == expected


@pytest.mark.parametrize(
    "base_url",
    [
        "http://gateway:50051",
        "https://gateway",
        "grpc://",
        "grpc://gateway:port",
        "grpc://gateway:70000",
        "grpc://gateway:50051/v1",
        "grpc://user@gateway:50051",
        "grpc://gateway:50051?tls=1",
    ],
)
def test_parse_base_url_rejects(base_url):
    with pytest.raises(ValueError, match="must look like"):
        parse_base_url(base_url)


def test_a_base_url_may_name_several_gateways_the_first_ones_scheme_for_all():
    assert parse_base_urls("grpcs://gw-a:443, gw-b") == [Endpoint("gw-a:443", True), Endpoint("gw-b:443", True)]
    assert parse_base_urls("gw-a:1,grpcs://gw-b:2") == [Endpoint("gw-a:1", False), Endpoint("gw-b:2", True)]
    with pytest.raises(ValueError, match="an empty gateway between its commas"):
        parse_base_urls("gw-a:1,,gw-b:2")


def test_each_call_goes_to_the_next_gateway_in_turn():
    with diptych.Client(api_key="k", base_url="grpc://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") as client:
        stubs = [client._transport.stub for _ in range(6)]
    assert len({id(stub) for stub in stubs[:3]}) == 3 and stubs[:3] == stubs[3:]


def test_client_rejects_bad_base_url():
    with pytest.raises(ValueError):
        diptych.Client(api_key="k", base_url="https://api.example.com")


@pytest.mark.parametrize(
    "options",
    [
        {"timeout": 0},
        {"timeout": -1.0},
        {"timeout": "5"},
        {"max_retries": -1},
        {"max_retries": 1.5},
        {"stream_idle_timeout": 0},
        {"admin_url": "ftp://host"},
        {"admin_url": "http://"},
        {"admin_url": "http://host:99999"},
    ],
)
def test_client_rejects_bad_options(options):
    with pytest.raises(ValueError):
        diptych.Client(api_key="k", **options)


def test_with_options_shares_the_channel_and_keeps_the_original():
    with diptych.Client(api_key="k") as client:
        fast = client.with_options(timeout=1.5, max_retries=0)
        assert (fast.timeout, fast.max_retries) == (1.5, 0)
        assert (client.timeout, client.max_retries, client.stream_idle_timeout) == (600.0, 2, 60.0)
        assert client.admin_url == "http://127.0.0.1:8000"
        assert fast._transport is client._transport
        assert fast.completions._client is fast and client.completions._client is client
        assert fast.chat.completions._client is fast and fast.models._client is fast
        assert client.with_options(timeout=None).timeout is None
        assert client.with_options(max_retries=5).timeout == 600.0
        assert client.with_options(stream_idle_timeout=None).stream_idle_timeout is None
        assert fast.admin.api_keys._client is fast and fast._admin_transport is client._admin_transport


def test_closed_client_refuses_calls():
    client = diptych.Client(api_key="k")
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.models.list()


async def test_async_client_context_manager():
    async with diptych.AsyncClient(api_key="k", base_url="grpc://localhost:1") as client:
        assert client.with_options(max_retries=0)._transport is client._transport
    with pytest.raises(RuntimeError, match="closed"):
        await client.models.list()
