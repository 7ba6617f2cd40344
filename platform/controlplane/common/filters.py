"""Query-string filters: validated like bodies, and an empty value (`?status=`) is an error, not "no filter"."""

from rest_framework import serializers


class QueryFilterSerializer(serializers.Serializer):
    def to_internal_value(self, data):
        empty = {name: ["Must not be empty."] for name in self.fields if name in data and data.get(name) == ""}
        if empty:
            raise serializers.ValidationError(empty)
        return super().to_internal_value(data)
