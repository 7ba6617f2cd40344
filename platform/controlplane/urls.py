from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path

from controlplane.common.docs import ApiIndexView, DocsView, SchemaView, docs_asset
from controlplane.common.exception_handler import error_body

# The public API: what the index lists and the public schema documents.
public_api_urlpatterns = [
    path("", include("controlplane.tenancy.urls")),
    path("", include("controlplane.catalog.urls")),
    path("", include("controlplane.metering.urls")),
    path("", include("controlplane.billing.urls")),
    path("", include("controlplane.batches.urls")),
    path("", include("controlplane.webhooks.urls")),
    path("", include("controlplane.responses.urls")),
]

api_v1_urlpatterns = [
    path("", ApiIndexView.as_view(patterns=public_api_urlpatterns), name="api-index"),
    path("schema/", SchemaView.as_view(patterns=[path("api/v1/", include(public_api_urlpatterns))]), name="schema"),
    path("docs/", DocsView.as_view(), name="docs"),
    path("docs/assets/<path:path>", docs_asset, name="docs-asset"),
    *public_api_urlpatterns,
    # Called by the gateway and the workers only: left out of the public schema.
    path("internal/", include("controlplane.internal.urls")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1_urlpatterns)),
    path("dashboard/", include("controlplane.dashboard.urls")),
]


def not_found(request: HttpRequest, exception: Exception) -> JsonResponse:
    return JsonResponse(error_body("not_found", f"No endpoint at {request.path}."), status=404)


def bad_request(request: HttpRequest, exception: Exception) -> JsonResponse:
    return JsonResponse(error_body("bad_request", f"Bad request: {exception}"), status=400)


def server_error(request: HttpRequest) -> JsonResponse:
    return JsonResponse(error_body("server_error", "Internal server error."), status=500)


handler400 = bad_request
handler404 = not_found
handler500 = server_error
