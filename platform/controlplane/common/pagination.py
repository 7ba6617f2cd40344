"""Limit/offset pagination for list endpoints built on APIView."""

from django.db.models import QuerySet
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer
from rest_framework.views import APIView


class DefaultPagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 1000


class PaginatedListMixin:
    """Gives an APIView a `pagination_class`, which drf-spectacular also reads to document the envelope."""

    pagination_class = DefaultPagination

    def paginated_response(
        self: APIView, *, queryset: QuerySet, serializer_class: type[Serializer], request: Request
    ) -> Response:
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(queryset, request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)
