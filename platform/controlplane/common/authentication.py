"""Bearer-token parsing and the authentication of the gateway on the internal endpoints."""

import hmac
from dataclasses import dataclass

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
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


@dataclass(frozen=True)
class InternalService:
    """The caller of an internal endpoint: the gateway, holding DIPTYCH_INTERNAL_TOKEN."""

    is_authenticated = True


class InternalTokenAuthentication(BearerAuthentication):
    realm = "internal"

    def authenticate(self, request: Request) -> tuple[InternalService, None] | None:
        token = bearer_token(request)
        if token is None:
            return None
        expected = settings.DIPTYCH_INTERNAL_TOKEN
        if not expected:
            raise exceptions.AuthenticationFailed(
                "Internal endpoints are disabled: DIPTYCH_INTERNAL_TOKEN is not set on the control plane.",
                code="internal_endpoints_disabled",
            )
        if not hmac.compare_digest(token.encode(), expected.encode()):
            raise exceptions.AuthenticationFailed("Invalid internal service token.", code="invalid_internal_token")
        return InternalService(), None


class InternalTokenAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = InternalTokenAuthentication
    name = "internalToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "DIPTYCH_INTERNAL_TOKEN of the control plane."}
