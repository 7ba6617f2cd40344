"""Query-string filters: validated like bodies, and an empty value (`?status=`) is an error, not "no filter"."""

from datetime import timedelta

from rest_framework import serializers


class QueryFilterSerializer(serializers.Serializer):
    def to_internal_value(self, data):
        empty = {name: ["Must not be empty."] for name in self.fields if name in data and data.get(name) == ""}
        if empty:
            raise serializers.ValidationError(empty)
        return super().to_internal_value(data)


MAX_DAY_RANGE = timedelta(days=366)


class DayRangeFilterSerializer(QueryFilterSerializer):
    """`start` and `end`: the first and last day (UTC, both included) of a range of at most 366 days."""

    start = serializers.DateField(help_text="The first day (UTC).")
    end = serializers.DateField(
        help_text=f"The last day (UTC), included: not before start, and at most {MAX_DAY_RANGE.days} days after it."
    )

    def validate(self, attrs: dict) -> dict:
        if attrs["end"] < attrs["start"]:
            raise serializers.ValidationError({"end": ["Must not be before start."]})
        if attrs["end"] - attrs["start"] > MAX_DAY_RANGE:
            raise serializers.ValidationError({"end": ["The range may span at most 366 days."]})
        return attrs
