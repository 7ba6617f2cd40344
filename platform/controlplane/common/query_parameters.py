"""Refuses a query parameter that the endpoint does not declare, naming it, rather than ignoring it: a
mistyped filter (`?stauts=open`) would otherwise answer as if no filter had been given.

What an endpoint declares is what its OpenAPI operation documents (filters, pagination), so the schema
and the check cannot drift apart. A view the schema leaves out (the schema and docs pages, the index)
declares its parameters in a `query_parameters` attribute.
"""

import re
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.views import APIView

from controlplane.common.exception_handler import error_body
from controlplane.common.openapi import full_schema

ROUTE_PARAMETER = re.compile(r"<(?:\w+:)?(\w+)>")


def schema_path(route: str) -> str:
    """`api/v1/api-keys/<str:key_id>` as the schema writes it: `/api/v1/api-keys/{key_id}`."""
    return "/" + ROUTE_PARAMETER.sub(r"{\1}", route)


def declared_query_parameters(route: str, method: str, view_class: type[APIView]) -> frozenset[str]:
    schema_method = "get" if method == "HEAD" else method.lower()
    operation = full_schema().get("paths", {}).get(schema_path(route), {}).get(schema_method)
    if operation is None:
        return frozenset(getattr(view_class, "query_parameters", ()))
    return frozenset(parameter["name"] for parameter in operation.get("parameters", []) if parameter["in"] == "query")


def _serves(view_class: type[APIView], method: str) -> bool:
    handler = "get" if method == "HEAD" else method.lower()
    return method.lower() in view_class.http_method_names and hasattr(view_class, handler)


class UnknownQueryParameterMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func, view_args, view_kwargs) -> HttpResponse | None:
        view_class = getattr(view_func, "cls", None)
        if not request.GET or not isinstance(view_class, type) or not issubclass(view_class, APIView):
            return None
        if not _serves(view_class, request.method):
            return None  # the view answers 405
        declared = declared_query_parameters(request.resolver_match.route, request.method, view_class)
        unknown = sorted(name for name in request.GET if name not in declared)
        if not unknown:
            return None
        accepted = ", ".join(sorted(declared)) if declared else "none"
        message = f"Unknown query parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
        message += f"{request.method} {request.path} accepts {accepted}."
        fields = {name: [f"Unknown query parameter; this endpoint accepts {accepted}."] for name in unknown}
        return JsonResponse(error_body("validation_error", message, fields), status=400)
