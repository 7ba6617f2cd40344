"""The internal API's contracts, checked against the control plane itself: every endpoint that
diptych_common/internal_api/endpoints.py names is served with the method its callers use, and each message
of diptych_common/internal_api/messages.py names the same fields, required or with the same default, as
the serializer that translates it over HTTP."""

import dataclasses

import pytest
from rest_framework import serializers

from controlplane.common.openapi import full_schema
from controlplane.internal.apis import ModelRegisterApi
from controlplane.internal.serializers import RefusalReportSerializer, UsageEventSerializer
from diptych_common.internal_api import endpoints
from diptych_common.internal_api.endpoints import Endpoint
from diptych_common.internal_api.messages import ModelRegistration, RefusalReport, RegisteredModel, UsageEvent

NAMED_ENDPOINTS = {name: value for name, value in vars(endpoints).items() if isinstance(value, Endpoint)}
REQUIRED = "(required)"


def test_the_scan_finds_the_endpoints():
    assert {"USAGE_EVENTS", "WORKER_HEARTBEAT", "MODEL_ARTIFACT_FILE"} <= set(NAMED_ENDPOINTS)


@pytest.mark.parametrize("name", sorted(NAMED_ENDPOINTS))
def test_every_endpoint_the_client_names_is_served_with_its_method(name):
    endpoint = NAMED_ENDPOINTS[name]
    served = full_schema()["paths"].get(endpoint.path, {})
    assert endpoint.method.lower() in served, (
        f"{name}: the control plane serves no {endpoint.method} {endpoint.path} (there: {sorted(served) or 'none'})"
    )


def message_fields(message: type) -> dict[str, object]:
    """Each field's default, or REQUIRED."""
    return {
        field.name: REQUIRED if field.default is dataclasses.MISSING else field.default
        for field in dataclasses.fields(message)
    }


def serializer_fields(serializer: serializers.Serializer) -> dict[str, object]:
    """Each field's default (`empty` for an optional field without one), or REQUIRED."""
    return {name: REQUIRED if field.required else field.default for name, field in serializer.fields.items()}


@pytest.mark.parametrize(
    ("message", "serializer", "file_parts"),
    [
        (UsageEvent, UsageEventSerializer(), set()),
        (RefusalReport, RefusalReportSerializer(), set()),
        (ModelRegistration, ModelRegisterApi.ModelRegisterInputSerializer(), {"files"}),
        (RegisteredModel, ModelRegisterApi.ModelRegisterOutputSerializer(), set()),
    ],
)
def test_a_message_and_its_serializer_agree_on_every_field(message, serializer, file_parts):
    """`file_parts`: the serializer's fields that carry files beside the message (multipart)."""
    fields = serializer_fields(serializer)
    assert file_parts <= set(fields)
    assert {name: default for name, default in fields.items() if name not in file_parts} == message_fields(message)
