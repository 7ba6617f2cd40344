from rest_framework.permissions import IsAuthenticated
from rest_framework.views import APIView

from controlplane.common.authentication import InternalTokenAuthentication


class InternalAPIView(APIView):
    """Base of the service-to-service endpoints that the gateway calls."""

    authentication_classes = [InternalTokenAuthentication]
    permission_classes = [IsAuthenticated]
