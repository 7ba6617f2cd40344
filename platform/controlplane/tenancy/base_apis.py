from rest_framework.permissions import IsAuthenticated
from rest_framework.views import APIView

from controlplane.tenancy.authentication import ApiKeyAuthentication
from controlplane.tenancy.models import Organization


class TenantAPIView(APIView):
    """Base of the public endpoints: every read and write is scoped to `self.organization`."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [IsAuthenticated]

    @property
    def organization(self) -> Organization:
        return self.request.user.organization
