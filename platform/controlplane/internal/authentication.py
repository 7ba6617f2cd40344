"""The two credentials of the internal endpoints: the gateway's shared token and a worker's fleet token."""

import hmac
from dataclasses import dataclass

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.request import Request

from controlplane.catalog.models import Fleet
from controlplane.catalog.selectors import fleet_get_by_token
from controlplane.catalog.services import FLEET_TOKEN_PREFIX
from controlplane.common.authentication import BearerAuthentication, bearer_token
from controlplane.common.tokens import is_well_formed_token


@dataclass(frozen=True)
class InternalService:
    """The caller of a gateway endpoint: the gateway, holding DIPTYCH_INTERNAL_TOKEN."""

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


@dataclass(frozen=True)
class FleetMember:
    """The caller of a worker endpoint: a worker holding its fleet's token."""

    fleet: Fleet
    is_authenticated = True


class FleetTokenAuthentication(BearerAuthentication):
    realm = "fleet"

    def authenticate(self, request: Request) -> tuple[FleetMember, Fleet] | None:
        token = bearer_token(request)
        if token is None:
            return None
        if not is_well_formed_token(token, FLEET_TOKEN_PREFIX):
            raise exceptions.AuthenticationFailed(
                "Malformed fleet token: expected 'dft_' followed by 38 base62 characters with a valid checksum.",
                code="fleet_token_malformed",
            )
        fleet = fleet_get_by_token(token=token)
        if fleet is None:
            raise exceptions.AuthenticationFailed(
                "Fleet token not recognised; tokens are replaced each time the control plane is bootstrapped.",
                code="fleet_token_not_recognised",
            )
        return FleetMember(fleet=fleet), fleet


class FleetTokenAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = FleetTokenAuthentication
    name = "fleetToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A fleet token (dft_...), for workers."}
