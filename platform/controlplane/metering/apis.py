from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.catalog.models import PriceTier
from controlplane.common.filters import DayRangeFilterSerializer, QueryFilterSerializer
from controlplane.common.pagination import PaginatedListMixin
from controlplane.metering.models import Phase, RefusalScope, RefusedLimit
from controlplane.metering.selectors import (
    REQUEST_GROUP_BY_FIELDS,
    rate_limit_refusals_daily,
    request_counts_daily,
    usage_event_list,
    usage_summary,
)
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView
from controlplane.tenancy.models import ApiKeyKind


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


class UsageRequestsApi(TenantAPIView):
    """Requests per day and API key, model or tier, counted from the ledger."""

    required_permissions = {"GET": Permission.USAGE_READ}

    class UsageRequestsFilterSerializer(DayRangeFilterSerializer):
        group_by = serializers.ChoiceField(choices=sorted(REQUEST_GROUP_BY_FIELDS), default="api_key")
        api_key_kind = serializers.ChoiceField(choices=ApiKeyKind.choices, required=False)
        project_id = serializers.CharField(required=False, max_length=64, help_text="Only this project's requests.")

    class UsageRequestsOutputSerializer(serializers.Serializer):
        class UsageRequestsRowSerializer(serializers.Serializer):
            day = serializers.DateField()
            key = serializers.CharField(help_text="An API key's id, a model name, a tier or a project's id.")
            requests = serializers.IntegerField()

        object = serializers.ChoiceField(choices=["list"])
        data = UsageRequestsRowSerializer(many=True)

    @extend_schema(parameters=[UsageRequestsFilterSerializer], responses=UsageRequestsOutputSerializer)
    def get(self, request: Request) -> Response:
        filters = self.UsageRequestsFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        rows = request_counts_daily(organization=self.organization, **filters.validated_data)
        return Response(self.UsageRequestsOutputSerializer({"object": "list", "data": rows}).data)


class RateLimitRefusalsApi(TenantAPIView):
    """Requests the gateways refused (HTTP 429, RESOURCE_EXHAUSTED) per day, API key and limit."""

    required_permissions = {"GET": Permission.USAGE_READ}

    class RateLimitRefusalOutputSerializer(serializers.Serializer):
        class RateLimitRefusalRowSerializer(serializers.Serializer):
            day = serializers.DateField()
            api_key_id = serializers.CharField()
            api_key_name = serializers.CharField()
            scope = serializers.ChoiceField(
                choices=RefusalScope.choices,
                help_text="Whose limit refused: the organization's, the project's or the key's.",
            )
            limit = serializers.ChoiceField(choices=RefusedLimit.choices)
            limit_value = serializers.IntegerField(help_text="The limit per minute when it refused.")
            refusals = serializers.IntegerField()
            last_refused_at = serializers.DateTimeField(help_text="The start of the last minute with a refusal.")

        object = serializers.ChoiceField(choices=["list"])
        data = RateLimitRefusalRowSerializer(many=True)

    @extend_schema(parameters=[DayRangeFilterSerializer], responses=RateLimitRefusalOutputSerializer)
    def get(self, request: Request) -> Response:
        filters = DayRangeFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        rows = rate_limit_refusals_daily(organization=self.organization, **filters.validated_data)
        return Response(self.RateLimitRefusalOutputSerializer({"object": "list", "data": rows}).data)
