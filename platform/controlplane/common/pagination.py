"""Pagination for list endpoints built on APIView: by limit and offset (`{"object": "list", "data": [...],
"has_more", "total"}`), and by cursor as OpenAI pages (`{"object": "list", "data", "first_id", "last_id",
"has_more"}`, the next page `after` the last id)."""

from django.db.models import QuerySet
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer
from rest_framework.views import APIView

from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.limits import MAX_BIG_INTEGER
from controlplane.common.querysets import MAX_PAGE, cursor_page

MAX_OFFSET = MAX_BIG_INTEGER  # the database takes a signed 64-bit offset


class DefaultPagination(LimitOffsetPagination):
    """Malformed `limit` or `offset` values are refused (400), never silently replaced by defaults."""

    default_limit = 50
    max_limit = 1000

    def get_limit(self, request: Request) -> int:
        return self._integer_param(
            request, self.limit_query_param, default=self.default_limit, low=1, high=self.max_limit
        )

    def get_offset(self, request: Request) -> int:
        return self._integer_param(request, self.offset_query_param, default=0, low=0, high=MAX_OFFSET)

    @staticmethod
    def _integer_param(request: Request, name: str, *, default: int, low: int, high: int) -> int:
        values = request.query_params.getlist(name)
        if not values:
            return default
        if len(values) > 1:
            raise ValidationError({name: ["Give it at most once."]})
        try:
            value = int(values[0])
        except ValueError:
            raise ValidationError({name: [f"Must be an integer between {low} and {high}."]}) from None
        if not low <= value <= high:
            raise ValidationError({name: [f"Must be an integer between {low} and {high}."]})
        return value

    def get_paginated_response(self, data) -> Response:
        has_more = self.offset + self.limit < self.count
        return Response({"object": "list", "data": data, "has_more": has_more, "total": self.count})

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, MAX_OFFSET)}
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"].update(minimum=low, maximum=high)
        return parameters

    def get_paginated_response_schema(self, schema: dict) -> dict:
        return {
            "type": "object",
            "required": ["object", "data", "has_more", "total"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": schema,
                "has_more": {"type": "boolean"},
                "total": {"type": "integer", "minimum": 0},
            },
        }


class PaginatedListMixin:
    """Gives an APIView a `pagination_class`, which drf-spectacular also reads to document the envelope."""

    pagination_class = DefaultPagination

    def paginated_response(
        self: APIView, *, queryset: QuerySet, serializer_class: type[Serializer], request: Request
    ) -> Response:
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(queryset, request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)


class CursorQuerySerializer(QueryFilterSerializer):
    after = serializers.CharField(required=False, max_length=64)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=MAX_PAGE, default=20)


def cursor_list_response(queryset: QuerySet, serializer_class: type[Serializer], request: Request) -> Response:
    """The page of `queryset` the request's `after` and `limit` ask for."""
    query = CursorQuerySerializer(data=request.query_params)
    query.is_valid(raise_exception=True)
    page = cursor_page(queryset, after=query.validated_data.get("after"), limit=query.validated_data["limit"])
    data = serializer_class(page.items, many=True).data
    return Response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )
