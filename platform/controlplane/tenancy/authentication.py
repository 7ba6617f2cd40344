"""Authentication of tenants on the public API by their organization's API key."""

from dataclasses import dataclass

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.request import Request

from controlplane.common.authentication import BearerAuthentication, bearer_token
from controlplane.common.errors import CredentialRejected
from controlplane.tenancy.models import ApiKey, Organization
from controlplane.tenancy.services import api_key_authenticate


@dataclass(frozen=True)
class Tenant:
    """The caller of a public endpoint: an organization, acting through one of its API keys."""

    organization: Organization
    api_key: ApiKey
    is_authenticated = True


class ApiKeyAuthentication(BearerAuthentication):
    def authenticate(self, request: Request) -> tuple[Tenant, ApiKey] | None:
        key = bearer_token(request)
        if key is None:
            return None
        try:
            api_key = api_key_authenticate(key=key)
        except CredentialRejected as rejection:
            raise exceptions.AuthenticationFailed(rejection.message, code=rejection.error_type) from None
        return Tenant(organization=api_key.organization, api_key=api_key), api_key


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An organization's API key (dip_...)."}
