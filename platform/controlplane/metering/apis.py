from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.catalog.models import PriceTier
from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.pagination import PaginatedListMixin
from controlplane.metering.models import Phase
from controlplane.metering.selectors import usage_event_list, usage_summary
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView


class UsageEventOutputSerializer(serializers.Serializer):
    request_id = serializers.CharField()
    client_request_id = serializers.CharField()
    phase = serializers.CharField()
    api_key_id = serializers.CharField(source="api_key.public_id")
    model = serializers.CharField()
    region = serializers.CharField()
    worker_id = serializers.CharField()
    tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    kv_bytes = serializers.IntegerField()
    compute_ms = serializers.IntegerField()
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    ingested_at = serializers.DateTimeField()
    tier = serializers.CharField(help_text="standard, or batch for a Batch API request.")


class UsageSummaryRowSerializer(serializers.Serializer):
    model = serializers.CharField()
    phase = serializers.CharField()
    tier = serializers.CharField()
    requests = serializers.IntegerField()
    tokens = serializers.IntegerField(help_text="Tokens billed at this phase's full price: cached tokens not included.")
    cached_tokens = serializers.IntegerField(
        help_text="Prefill tokens served from the prefix cache, billed at the cached-prefill price; beside `tokens`."
    )


class UsageSummaryOutputSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = UsageSummaryRowSerializer(many=True)


class UsageEventListApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.USAGE_READ}

    class UsageEventFilterSerializer(QueryFilterSerializer):
        request_id = serializers.CharField(required=False)
        client_request_id = serializers.CharField(required=False)
        phase = serializers.ChoiceField(choices=Phase.choices, required=False)
        model = serializers.CharField(required=False)
        tier = serializers.ChoiceField(choices=PriceTier.choices, required=False)

    @extend_schema(parameters=[UsageEventFilterSerializer], responses=UsageEventOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.UsageEventFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return self.paginated_response(
            queryset=usage_event_list(organization=self.organization, **filters.validated_data),
            serializer_class=UsageEventOutputSerializer,
            request=request,
        )


class UsageSummaryApi(TenantAPIView):
    required_permissions = {"GET": Permission.USAGE_READ}

    @extend_schema(responses=UsageSummaryOutputSerializer)
    def get(self, request: Request) -> Response:
        rows = usage_summary(organization=self.organization)
        return Response(UsageSummaryOutputSerializer({"object": "list", "data": rows}).data)
