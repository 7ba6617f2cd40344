"""Errors that services and selectors raise; the API layer maps each kind to an HTTP status."""

from collections.abc import Mapping


class ApplicationError(Exception):
    """A failure the caller can act on, described by a stable type and a readable message."""

    error_type = "invalid_request"

    def __init__(self, message: str, *, error_type: str | None = None, fields: Mapping[str, list[str]] | None = None):
        super().__init__(message)
        self.message = message
        self.error_type = error_type or self.error_type
        self.fields = dict(fields) if fields else None


class InvalidInput(ApplicationError):
    error_type = "validation_error"


class ObjectNotFound(ApplicationError):
    error_type = "not_found"


class CredentialRejected(ApplicationError):
    error_type = "authentication_failed"


class ObjectGone(ApplicationError):
    error_type = "gone"


class PermissionRefused(ApplicationError):
    error_type = "permission_denied"


def body_too_large_message(limit: int) -> str:
    return f"Request body too large: at most {limit} bytes are accepted; send less data per request."
