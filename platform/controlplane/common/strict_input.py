"""Request bodies read strictly: a field the endpoint does not take is an error naming it, never ignored,
and a count is a JSON integer (not "5", 5.0 or true)."""

from rest_framework import serializers


class StrictInputSerializer(serializers.Serializer):
    """Refuses fields it does not declare. `refused_fields` maps a field it knows of but does not take here
    to the message that says where it belongs."""

    refused_fields: dict[str, str] = {}

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
        return super().to_internal_value(data)


class WholeNumberField(serializers.IntegerField):
    """An integer sent as a JSON number without a fraction."""

    default_error_messages = {"invalid": "Must be a whole number (a JSON integer), not {input!r}."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid", input=data)
        return super().to_internal_value(data)
