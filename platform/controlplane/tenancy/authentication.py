"""Authentication on the public API: an organization's API key, or a signed-in user's session."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.request import Request

from controlplane.common.authentication import BearerAuthentication, bearer_token
from controlplane.common.errors import CredentialRejected
from controlplane.tenancy.access import Principal
from controlplane.tenancy.models import ApiKey
from controlplane.tenancy.services import api_key_authenticate


class ApiKeyAuthentication(BearerAuthentication):
    def authenticate(self, request: Request) -> tuple[Principal, ApiKey] | None:
        key = bearer_token(request)
        if key is None:
            return None
        try:
            api_key = api_key_authenticate(key=key)
        except CredentialRejected as rejection:
            raise exceptions.AuthenticationFailed(rejection.message, code=rejection.error_type) from None
        return Principal.of_api_key(api_key), api_key


class MemberSessionAuthentication(SessionAuthentication):
    """Django's session (the dashboard), with CSRF enforced on unsafe methods as DRF does."""

    def authenticate(self, request: Request) -> tuple[Principal, None] | None:
        authenticated = super().authenticate(request)
        if authenticated is None:
            return None
        user, _ = authenticated
        return Principal.of_user(user), None

    def authenticate_header(self, request: Request) -> str:
        # Answer 401 (not 403) to anonymous calls, like the bearer schemes.
        return 'Session realm="dashboard"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An organization's API key (dip_...)."}


class MemberSessionAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = MemberSessionAuthentication
    name = "session"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "cookie", "name": "sessionid"}
