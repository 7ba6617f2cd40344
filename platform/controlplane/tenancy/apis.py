from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.common.base_apis import InternalAPIView
from controlplane.common.pagination import PaginatedListMixin
from controlplane.tenancy.base_apis import TenantAPIView
from controlplane.tenancy.selectors import api_key_get, api_key_list
from controlplane.tenancy.services import api_key_authenticate, api_key_create, api_key_revoke


class OrganizationOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    name = serializers.CharField()
    slug = serializers.CharField()
    created_at = serializers.DateTimeField()


class ApiKeyOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    name = serializers.CharField()
    prefix = serializers.CharField()
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)


class OrganizationDetailApi(TenantAPIView):
    @extend_schema(responses=OrganizationOutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(OrganizationOutputSerializer(self.organization).data)


class ApiKeyListCreateApi(PaginatedListMixin, TenantAPIView):
    class ApiKeyCreateInputSerializer(serializers.Serializer):
        name = serializers.CharField(max_length=100)
        expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)

    class ApiKeyCreatedOutputSerializer(ApiKeyOutputSerializer):
        key = serializers.CharField(help_text="The full API key. It is shown only in this response.")

    @extend_schema(responses=ApiKeyOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        return self.paginated_response(
            queryset=api_key_list(organization=self.organization),
            serializer_class=ApiKeyOutputSerializer,
            request=request,
        )

    @extend_schema(request=ApiKeyCreateInputSerializer, responses={201: ApiKeyCreatedOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.ApiKeyCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = api_key_create(organization=self.organization, **serializer.validated_data)
        data = {**ApiKeyOutputSerializer(issued.api_key).data, "key": issued.key}
        return Response(data, status=status.HTTP_201_CREATED)


class ApiKeyDetailApi(TenantAPIView):
    @extend_schema(responses=ApiKeyOutputSerializer)
    def get(self, request: Request, key_id: str) -> Response:
        api_key = api_key_get(organization=self.organization, public_id=key_id)
        return Response(ApiKeyOutputSerializer(api_key).data)


class ApiKeyRevokeApi(TenantAPIView):
    @extend_schema(request=None, responses=ApiKeyOutputSerializer)
    def post(self, request: Request, key_id: str) -> Response:
        api_key = api_key_get(organization=self.organization, public_id=key_id)
        api_key = api_key_revoke(api_key=api_key)
        return Response(ApiKeyOutputSerializer(api_key).data)


class ApiKeyVerifyApi(InternalAPIView):
    class ApiKeyVerifyInputSerializer(serializers.Serializer):
        api_key = serializers.CharField(trim_whitespace=False)

    class ApiKeyVerifyOutputSerializer(serializers.Serializer):
        api_key_id = serializers.CharField(source="public_id")
        organization_id = serializers.CharField(source="organization.public_id")

    @extend_schema(request=ApiKeyVerifyInputSerializer, responses=ApiKeyVerifyOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.ApiKeyVerifyInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        api_key = api_key_authenticate(key=serializer.validated_data["api_key"])
        return Response(self.ApiKeyVerifyOutputSerializer(api_key).data)
