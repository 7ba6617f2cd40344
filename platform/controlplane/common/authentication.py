"""Bearer-token parsing and the base of every bearer-token authentication."""

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None when there is no such header."""
    parts = _authorization_header(request).split()
    if not parts or parts[0].lower() != "bearer":
        return None
    if len(parts) != 2:
        raise exceptions.AuthenticationFailed(
            "Malformed Authorization header: expected 'Bearer <token>'.", code="malformed_authorization_header"
        )
    if not parts[1].isascii():
        raise exceptions.AuthenticationFailed(
            "Malformed Authorization header: the token must be ASCII.", code="malformed_authorization_header"
        )
    return parts[1]


def _authorization_header(request: Request) -> str:
    """The header as text. DRF's get_authorization_header encodes it as Latin-1, which raises (a 500) on
    characters outside Latin-1; only the token's ASCII-ness matters here."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if isinstance(header, bytes):
        return header.decode("latin-1")
    return header


class BearerAuthentication(BaseAuthentication):
    realm = "api"

    def authenticate_header(self, request: Request) -> str:
        # A non-empty header makes DRF answer 401 rather than 403 to unauthenticated calls.
        return f'Bearer realm="{self.realm}"'
