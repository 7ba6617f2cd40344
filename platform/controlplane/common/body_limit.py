"""Refuses a request whose body is over DATA_UPLOAD_MAX_MEMORY_SIZE before anything reads it; a view that
takes larger bodies names its own limit in `max_body_bytes` (None: none)."""

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from controlplane.common.errors import body_too_large_message
from controlplane.common.exception_handler import error_body


def _declared_length(request: HttpRequest) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


class RequestBodyLimitMiddleware:
    """Answers 413 in the API's JSON error shape, where Django would raise RequestDataTooBig only when
    the body is read (and DRF, reading the stream itself, would not check at all)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(self, request: HttpRequest, view_func, view_args, view_kwargs) -> HttpResponse | None:
        view_class = getattr(view_func, "cls", None)
        limit = getattr(view_class, "max_body_bytes", settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        if limit is not None and _declared_length(request) > limit:
            return JsonResponse(error_body("request_too_large", body_too_large_message(limit)), status=413)
        return None
