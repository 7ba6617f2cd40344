"""Authentication of workers by their fleet's token on the registration and heartbeat endpoints."""

from dataclasses import dataclass

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.request import Request

from controlplane.catalog.models import Fleet
from controlplane.catalog.selectors import fleet_get_by_token
from controlplane.catalog.services import FLEET_TOKEN_PREFIX
from controlplane.common.authentication import BearerAuthentication, bearer_token
from controlplane.common.tokens import is_well_formed_token


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
