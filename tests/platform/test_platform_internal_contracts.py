"""The internal API's contracts: each message of diptych_common/internal_api/messages.py names the same
fields, required or with the same default, as the serializer that translates it over HTTP."""

import dataclasses

import pytest
from rest_framework import serializers

from controlplane.internal.serializers import UsageEventSerializer
from diptych_common.internal_api.messages import UsageEvent


def message_fields(message: type) -> dict[str, object]:
    """Each field's default; MISSING for a required one."""
    return {field.name: field.default for field in dataclasses.fields(message)}


def serializer_fields(serializer: serializers.Serializer) -> dict[str, object]:
    """Each field's default, `empty` for an optional one without; MISSING for a required one."""
    return {name: dataclasses.MISSING if field.required else field.default for name, field in serializer.fields.items()}


@pytest.mark.parametrize(("message", "serializer"), [(UsageEvent, UsageEventSerializer())])
def test_a_message_and_its_serializer_agree_on_every_field(message, serializer):
    assert serializer_fields(serializer) == message_fields(message)
