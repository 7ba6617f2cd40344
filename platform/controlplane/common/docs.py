"""The API's front door: the index at `/api/v1/`, the public schema, and Swagger UI at `/api/v1/docs/`, whose
scripts and styles are served from the installed drf-spectacular-sidecar package (no CDN)."""

from pathlib import Path

import drf_spectacular_sidecar
from django.core.exceptions import SuspiciousFileOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, URLResolver, reverse
from django.views.static import serve
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.openapi import SCHEMA_GENERATION

SWAGGER_UI_DIST = (
    Path(drf_spectacular_sidecar.__file__).parent / "static" / "drf_spectacular_sidecar" / "swagger-ui-dist"
)


class SchemaView(SpectacularAPIView):
    """The public schema: built from the patterns it is given, which leave out the internal endpoints."""

    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]
    query_parameters = ("format", "lang", "version")

    def _get_schema_response(self, request):
        with SCHEMA_GENERATION:
            return super()._get_schema_response(request)


class DocsView(SpectacularSwaggerView):
    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]
    query_parameters = ("lang", "version")

    @staticmethod
    def _swagger_ui_resource(filename: str) -> str:
        return reverse("docs-asset", kwargs={"path": filename})

    @staticmethod
    def _swagger_ui_favicon() -> str:
        return reverse("docs-asset", kwargs={"path": "favicon-32x32.png"})


def docs_asset(request: HttpRequest, path: str) -> HttpResponse:
    try:
        response = serve(request, path, document_root=SWAGGER_UI_DIST)
    except SuspiciousFileOperation:  # a path leading out of the folder
        raise Http404(f"No docs asset {path}") from None
    response["Cache-Control"] = "public, max-age=86400"
    return response


def collection_routes(patterns: list, prefix: str = "") -> list[str]:
    """The routes among `patterns` that name no object (`api-keys`, not `api-keys/<str:key_id>`)."""
    routes = []
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            routes.extend(collection_routes(pattern.url_patterns, route))
        elif isinstance(pattern, URLPattern) and "<" not in route:
            routes.append(route)
    return sorted(set(routes))


class ApiIndexView(APIView):
    """What the API holds and where its documentation is; `patterns` are the public endpoints."""

    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]
    patterns: list = []

    @extend_schema(exclude=True)
    def get(self, request: Request) -> Response:
        base = reverse("api-index")
        return Response(
            {
                "object": "api",
                "version": "v1",
                "docs_url": request.build_absolute_uri(reverse("docs")),
                "schema_url": request.build_absolute_uri(reverse("schema")),
                "resources": {
                    route: request.build_absolute_uri(base + route) for route in collection_routes(self.patterns)
                },
            }
        )
