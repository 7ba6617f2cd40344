from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from controlplane.common.exception_handler import error_body

api_v1_urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="schema"),
    path("", include("controlplane.tenancy.urls")),
    path("", include("controlplane.catalog.urls")),
    path("", include("controlplane.metering.urls")),
    path("", include("controlplane.billing.urls")),
    path("", include("controlplane.batches.urls")),
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
