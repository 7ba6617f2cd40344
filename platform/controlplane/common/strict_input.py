"""Request bodies read strictly: a field the endpoint does not take is an error naming it, never ignored,
and a count is a JSON integer (not "5", 5.0 or true)."""

from rest_framework import serializers
from rest_framework.settings import api_settings


class StrictInputSerializer(serializers.Serializer):
    """Refuses fields it does not declare, and with `requires_a_field` a body that names none of them.
    `refused_fields` maps a field it knows of but does not take here to the message that says where it
    belongs. The schema says the same (`additionalProperties: false`, `minProperties: 1`; common/openapi.py)."""

    refused_fields: dict[str, str] = {}
    requires_a_field = False

    def to_internal_value(self, data):
        if isinstance(data, dict):
            accepted = ", ".join(self.fields)
            problems = {
                name: [self.refused_fields.get(name) or f"Unknown field; this endpoint accepts {accepted}."]
                for name in data
                if name not in self.fields
            }
            if problems:
                raise serializers.ValidationError(problems)
            if self.requires_a_field and not data:
                raise serializers.ValidationError(
                    {api_settings.NON_FIELD_ERRORS_KEY: [f"Give at least one of {accepted}."]}
                )
        return super().to_internal_value(data)


class WholeNumberField(serializers.IntegerField):
    """An integer sent as a JSON number without a fraction."""

    default_error_messages = {"invalid": "Must be a whole number (a JSON integer), not {input!r}."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid", input=data)
        return super().to_internal_value(data)


class TextField(serializers.CharField):
    """Text sent as a JSON string: a number is refused, not turned into its digits."""

    default_error_messages = {"not_text": "Must be text (a JSON string), not {input!r}."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("not_text", input=data)
        return super().to_internal_value(data)
