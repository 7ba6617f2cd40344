"""Bad input gets a clear 4xx in the API's JSON error shape, never a 500 or an HTML page, and changes nothing."""

import json

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from controlplane.common.parsers import MAX_JSON_DEPTH, BoundedJSONParser, RequestTooLarge
from controlplane.metering.models import UsageEvent
from controlplane.metering.services import MAX_EVENTS_PER_BATCH
from controlplane.tenancy.models import ApiKey

KEYS_URL = "/api/v1/api-keys"
INGEST_URL = "/api/v1/internal/usage-events"


def post_raw(client: APIClient, url: str, body: bytes | str):
    return client.post(url, data=body, content_type="application/json")


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.content[:500]
    assert response["Content-Type"] == "application/json"
    error = json.loads(response.content)["error"]
    assert set(error) <= {"type", "message", "fields"} and error["message"]
    return error


def nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_objects(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    "body",
    [nested_arrays(100_000), nested_objects(100_000), nested_arrays(MAX_JSON_DEPTH + 1)],
    ids=["arrays-100000", "objects-100000", "arrays-just-too-deep"],
)
def test_deeply_nested_json_is_a_400_that_changes_nothing(client_a, body):
    error = error_of(post_raw(client_a, KEYS_URL, body), 400)
    assert error["type"] == "parse_error"
    assert f"at most {MAX_JSON_DEPTH} levels" in error["message"]
    assert not ApiKey.objects.filter(name="x").exists()


def test_nesting_up_to_the_limit_is_parsed(client_a):
    """The bound refuses only what is deeper than it: the body below reaches the view, which refuses its
    content, not its shape."""
    body = json.dumps({"name": "x", "scopes": json.loads(nested_arrays(MAX_JSON_DEPTH - 1))})
    error = error_of(post_raw(client_a, KEYS_URL, body), 400)
    assert error["type"] == "validation_error"


def test_invalid_utf8_is_a_400_naming_the_byte(client_a):
    error = error_of(post_raw(client_a, KEYS_URL, b'{"name": "x\xff", "scopes": ["inference"]}'), 400)
    assert error["type"] == "parse_error"
    assert "not valid UTF-8" in error["message"] and "0xff" in error["message"]
    assert list(ApiKey.objects.values_list("name", flat=True)) == ["acme-main"]


@pytest.mark.parametrize(
    "body",
    ['{"name": "\\ud800", "scopes": ["inference"]}', '{"name": "x", "scopes": ["inference"], "\\udfff": 1}'],
    ids=["in-a-value", "in-a-key"],
)
def test_a_lone_surrogate_is_a_400_naming_where_it_is(client_a, body):
    error = error_of(post_raw(client_a, KEYS_URL, body), 400)
    assert error["type"] == "parse_error"
    assert "lone UTF-16 surrogate" in error["message"]
    assert list(ApiKey.objects.values_list("name", flat=True)) == ["acme-main"]


def test_a_surrogate_pair_is_valid_text(client_a):
    response = post_raw(client_a, KEYS_URL, '{"name": "k\\ud83d\\ude00", "scopes": ["inference"]}')
    assert response.status_code == 201
    assert ApiKey.objects.get(public_id=response.data["id"]).name == "k\N{GRINNING FACE}"


def test_nan_is_a_400(internal_client, key_a, make_usage_event):
    body = json.dumps({"events": [make_usage_event(key_a)]}).replace('"tokens": 120', '"tokens": NaN')
    error = error_of(post_raw(internal_client, INGEST_URL, body), 400)
    assert "NaN" in error["message"]
    assert not UsageEvent.objects.exists()


@pytest.mark.parametrize("url", [KEYS_URL, INGEST_URL])
def test_a_body_over_the_limit_is_a_json_413(client_a, internal_client, url):
    client = internal_client if url == INGEST_URL else client_a
    body = '{"name": "x", "scopes": ["inference"], "padding": "' + "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE + '"}'
    error = error_of(post_raw(client, url, body), 413)
    assert error["type"] == "request_too_large"
    assert f"at most {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes" in error["message"]
    assert not ApiKey.objects.filter(name="x").exists()


def test_a_body_longer_than_the_limit_is_refused_by_the_parser(settings):
    """Without a Content-Length over the limit (a chunked body on ASGI) the parser still stops reading."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64

    class Stream:
        def read(self, size=-1):
            return b"[" + b" " * (size - 1 if size > 0 else 10_000) + b"]"

    with pytest.raises(RequestTooLarge, match="at most 64 bytes"):
        BoundedJSONParser().parse(Stream())


def maximal_usage_event(make_usage_event, key, index: int) -> dict:
    """A valid event with every free-text field at its maximum length, in non-ASCII text that JSON
    escapes as \\uXXXX (six bytes a character), as the gateway's encoder does."""
    return make_usage_event(
        key,
        request_id=f"{index:04d}" + "é" * 124,
        client_request_id="c" * 128,
        region="é" * 64,
        worker_id="é" * 64,
        tokens=2**63 - 1,
        cached_tokens=2**63 - 1,
        kv_bytes=2**63 - 1,
        compute_ms=2**63 - 1,
    )


def test_the_largest_legitimate_usage_batch_fits_under_the_limit(internal_client, key_a, make_usage_event):
    events = [maximal_usage_event(make_usage_event, key_a, index) for index in range(MAX_EVENTS_PER_BATCH)]
    body = json.dumps({"events": events})
    assert len(body) <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    response = post_raw(internal_client, INGEST_URL, body)
    assert response.status_code == 200, response.content[:500]
    assert response.data == {"accepted": MAX_EVENTS_PER_BATCH, "duplicates": 0}


@pytest.mark.parametrize(
    ("header", "error_type"),
    [
        ("Bearer d\u00e9p", "malformed_authorization_header"),
        ("Bearer \u20ac", "malformed_authorization_header"),
        ("B\u00e9arer abc", "not_authenticated"),
        ("Bearer a b", "malformed_authorization_header"),
    ],
    ids=["latin1-token", "non-latin1-token", "non-ascii-scheme", "three-parts"],
)
@pytest.mark.parametrize("url", ["/api/v1/organization", INGEST_URL])
def test_a_non_ascii_authorization_header_is_a_401(db, header, error_type, url):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get(url) if url != INGEST_URL else client.post(url, {"events": []}, format="json")
    assert error_of(response, 401)["type"] == error_type


def test_a_suspicious_request_is_answered_in_json(db, settings):
    settings.DEBUG = False
    response = APIClient().get("/api/v1/organization", HTTP_HOST="evil.example")
    error = error_of(response, 400)
    assert error["type"] == "bad_request"
