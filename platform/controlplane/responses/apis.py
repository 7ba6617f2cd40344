"""What an organization's stored responses take, for the owners of the organization (the responses themselves
are the gateway's to serve, at `/v1/responses`)."""

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.responses.selectors import response_storage
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView


class ResponseStorageApi(TenantAPIView):
    required_permissions = {"GET": Permission.USAGE_READ}

    class ResponseStorageOutputSerializer(serializers.Serializer):
        object = serializers.ChoiceField(choices=["response_storage"])
        responses = serializers.IntegerField(help_text="Stored responses not expired yet.")
        bytes = serializers.IntegerField(help_text="What they take: items, options and conversation token ids.")
        retention_days = serializers.IntegerField(help_text="How long a response is kept after it was created.")

    @extend_schema(responses=ResponseStorageOutputSerializer)
    def get(self, request: Request) -> Response:
        storage = response_storage(organization=self.organization)
        body = {
            "object": "response_storage",
            "responses": storage.responses,
            "bytes": storage.bytes,
            "retention_days": settings.DIPTYCH_RESPONSE_RETENTION_DAYS,
        }
        return Response(self.ResponseStorageOutputSerializer(body).data)
