from rest_framework.permissions import IsAuthenticated
from rest_framework.views import APIView

from controlplane.catalog.models import Fleet
from controlplane.internal.authentication import FleetTokenAuthentication, InternalTokenAuthentication


class InternalAPIView(APIView):
    """Base of the service-to-service endpoints that the gateway calls."""

    authentication_classes = [InternalTokenAuthentication]
    permission_classes = [IsAuthenticated]


class FleetAPIView(APIView):
    """Base of the endpoints that workers call with their fleet's token."""

    authentication_classes = [FleetTokenAuthentication]
    permission_classes = [IsAuthenticated]

    @property
    def fleet(self) -> Fleet:
        return self.request.user.fleet
