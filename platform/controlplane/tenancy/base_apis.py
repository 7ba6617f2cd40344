from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.views import APIView

from controlplane.common.idempotency import IdempotentPostMixin
from controlplane.tenancy.access import Permission, Principal
from controlplane.tenancy.authentication import ApiKeyAuthentication, MemberSessionAuthentication
from controlplane.tenancy.models import Organization

PUBLIC_AUTHENTICATION = [ApiKeyAuthentication, MemberSessionAuthentication]


def _principal(request: Request) -> Principal | None:
    principal = request.user
    return principal if isinstance(principal, Principal) else None


class HasOrganizationPermission(BasePermission):
    """The caller acts within an organization and holds the permission the view names for this method."""

    def has_permission(self, request: Request, view: "TenantAPIView") -> bool:
        principal = _principal(request)
        if principal is None:
            return False
        if principal.organization is None:
            self.message = "You are not a member of any organization."
            return False
        method = "GET" if request.method in ("HEAD", "OPTIONS") else request.method
        if not hasattr(view, method.lower()):  # the method is not served: let the view answer 405
            return True
        required = view.required_permissions.get(method)
        if required is None:  # fail closed: an endpoint that names no permission serves nobody
            self.message = f"{method} {request.path} declares no permission; refusing."
            return False
        if principal.can(required):
            return True
        if principal.api_key is not None:
            who = f"API key scopes {', '.join(principal.api_key.scopes)}"
        else:
            who = f"role {principal.role}"
        self.message = f"This needs the {required} permission, which your {who} does not grant."
        return False


class IsStaff(BasePermission):
    message = "Only staff users (signed in to the dashboard) may use this endpoint."

    def has_permission(self, request: Request, view: APIView) -> bool:
        principal = _principal(request)
        return principal is not None and principal.is_staff


class PrincipalIdempotency(IdempotentPostMixin):
    def idempotency_caller(self) -> str:
        return self.request.user.authority


class TenantAPIView(PrincipalIdempotency, APIView):
    """Base of the public endpoints: every read and write is scoped to `self.organization`, and every POST
    honours Idempotency-Key.

    Subclasses name the permission each method needs in `required_permissions`.
    """

    authentication_classes = PUBLIC_AUTHENTICATION
    permission_classes = [HasOrganizationPermission]
    required_permissions: dict[str, Permission] = {}

    @property
    def principal(self) -> Principal:
        return self.request.user

    @property
    def organization(self) -> Organization:
        return self.request.user.organization


class StaffAPIView(PrincipalIdempotency, APIView):
    """Base of the endpoints over the platform itself (fleets, workers, prices): staff sessions only."""

    authentication_classes = PUBLIC_AUTHENTICATION
    permission_classes = [IsStaff]

    @property
    def principal(self) -> Principal:
        return self.request.user
