"""One error shape for the whole API: {"error": {"type", "message", "fields"?}}."""

from collections.abc import Iterator

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

from controlplane.common.errors import (
    ApplicationError,
    CredentialRejected,
    InvalidInput,
    ObjectGone,
    ObjectNotFound,
    PermissionRefused,
)

STATUS_BY_APPLICATION_ERROR = {
    InvalidInput: status.HTTP_400_BAD_REQUEST,
    CredentialRejected: status.HTTP_401_UNAUTHORIZED,
    ObjectNotFound: status.HTTP_404_NOT_FOUND,
    PermissionRefused: status.HTTP_403_FORBIDDEN,
    ObjectGone: status.HTTP_410_GONE,
}

NON_FIELD_KEYS = {api_settings.NON_FIELD_ERRORS_KEY, "non_field_errors"}


def error_body(error_type: str, message: str, fields: dict[str, list[str]] | None = None) -> dict:
    body: dict[str, object] = {"type": error_type, "message": message}
    if fields:
        body["fields"] = fields
    return {"error": body}


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, ApplicationError):
        set_rollback()
        return Response(
            error_body(exc.error_type, exc.message, exc.fields),
            status=_status_of_application_error(exc),
        )
    api_exception = _as_api_exception(exc)
    if api_exception is None:  # a fault of ours: DRF re-raises it, a 500
        return None
    response = drf_exception_handler(api_exception, context)
    if isinstance(api_exception, exceptions.ValidationError):
        response.data = _validation_error_body(api_exception.detail)
    else:
        response.data = error_body(_error_type(api_exception), _message(api_exception.detail))
    return response


def _as_api_exception(exc: Exception) -> exceptions.APIException | None:
    """The DRF exception `exc` stands for; None for an exception that is no error of the caller's."""
    if isinstance(exc, exceptions.APIException):
        return exc
    if isinstance(exc, DjangoValidationError):
        return exceptions.ValidationError(as_serializer_error(exc))
    if isinstance(exc, Http404):
        return exceptions.NotFound(*exc.args)
    if isinstance(exc, DjangoPermissionDenied):
        return exceptions.PermissionDenied(*exc.args)
    return None


def _status_of_application_error(exc: ApplicationError) -> int:
    for error_class, status_code in STATUS_BY_APPLICATION_ERROR.items():
        if isinstance(exc, error_class):
            return status_code
    return status.HTTP_400_BAD_REQUEST


def _error_type(exc: exceptions.APIException) -> str:
    code = getattr(exc.detail, "code", None)
    return code if isinstance(code, str) else exc.default_code


def _message(detail) -> str:
    if isinstance(detail, list) and detail:
        return str(detail[0])
    return str(detail)


def _validation_error_body(detail) -> dict:
    problems = list(_flatten_errors(detail, path=""))
    fields: dict[str, list[str]] = {}
    for path, message in problems:
        fields.setdefault(path or "non_field_errors", []).append(message)
    if not problems:
        return error_body("validation_error", "Invalid input.")
    first_path, first_message = problems[0]
    message = f"{first_path}: {first_message}" if first_path else first_message
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return error_body("validation_error", message, fields)


def _flatten_errors(detail, *, path: str) -> Iterator[tuple[str, str]]:
    """Yield (path, message) pairs, with paths such as `events[3].phase`."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            yield from _flatten_errors(value, path=path if key in NON_FIELD_KEYS else _child_path(path, key))
    elif isinstance(detail, list):
        for index, item in enumerate(detail):
            if isinstance(item, str):
                yield path, str(item)
            elif item:
                yield from _flatten_errors(item, path=f"{path}[{index}]")
    else:
        yield path, str(detail)


def _child_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)
