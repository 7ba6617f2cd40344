from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.catalog.models import PriceTier
from controlplane.common.filters import DayRangeFilterSerializer, QueryFilterSerializer
from controlplane.common.pagination import PaginatedListMixin
from controlplane.metering.models import Phase, RefusalScope, RefusedLimit
from controlplane.metering.request_phases import PhaseKind, Route
from controlplane.metering.selectors import (
    MAX_REQUEST_LOG_PAGE,
    REQUEST_GROUP_BY_FIELDS,
    latency_percentiles_daily,
    rate_limit_refusals_daily,
    request_counts_daily,
    request_log,
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


# ---- requests and their phases -----------------------------------------------------------------------------


class RequestPhaseOutputSerializer(serializers.Serializer):
    type = serializers.ChoiceField(
        source="kind",
        choices=PhaseKind.CHOICES,
        help_text="prefill, kv_handoff, decode, or colocated: one worker did both and no KV cache moved.",
    )
    worker_id = serializers.CharField(allow_null=True, help_text="Null for the KV hand-off.")
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    offset_ms = serializers.FloatField(help_text="From the request's start to this phase's.")
    duration_ms = serializers.FloatField(
        help_text="Wall time as the gateway saw it. kv_handoff: from the prefill event's finished_at to the decode "
        "event's started_at (0 when they touch): the gateway starts the decode clock once the first token is in, so "
        "the transfer itself overlaps decode and is inside decode's duration."
    )
    compute_ms = serializers.IntegerField(
        allow_null=True, help_text="The worker's own compute time (colocated: the whole call's)."
    )
    queued_ms = serializers.FloatField(
        allow_null=True,
        help_text="prefill and colocated: wall time to the first token minus the prefill's compute_ms (queueing "
        "and transport).",
    )
    computed_tokens = serializers.IntegerField(allow_null=True, help_text="Prompt tokens computed (not cached).")
    cached_tokens = serializers.IntegerField(allow_null=True, help_text="Prompt tokens from the prefix cache.")
    output_tokens = serializers.IntegerField(allow_null=True)
    kv_bytes = serializers.IntegerField(allow_null=True, help_text="kv_handoff: the bytes the prefill worker sent.")


class RequestTotalsOutputSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    computed_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    kv_bytes = serializers.IntegerField()
    compute_ms = serializers.IntegerField()


class RequestTimelineOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="request_id", help_text="The X-Request-Id the gateway answered (exec_…).")
    object = serializers.SerializerMethodField()
    client_request_id = serializers.CharField(help_text="The client's own label of the request; may be empty.")
    model = serializers.CharField()
    tier = serializers.ChoiceField(choices=PriceTier.choices)
    api_key_id = serializers.CharField()
    project_id = serializers.CharField()
    route = serializers.ChoiceField(
        choices=Route.CHOICES,
        help_text="decode_only: choice 1..n-1 of an n > 1 request (its prompt is billed on choice 0, the request's "
        "own id).",
    )
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    duration_ms = serializers.FloatField()
    time_to_first_token_ms = serializers.FloatField(
        allow_null=True, help_text="The prefill phase's wall time; null without a prefill phase."
    )
    phases = RequestPhaseOutputSerializer(many=True, help_text="In time order.")
    totals = RequestTotalsOutputSerializer()

    def get_object(self, timeline) -> str:
        return "usage.request"


class RequestLogApi(TenantAPIView):
    """The organization's requests, newest first, each with its phases and their timings (cursor pages)."""

    required_permissions = {"GET": Permission.USAGE_READ}

    class RequestLogFilterSerializer(DayRangeFilterSerializer):
        api_key_id = serializers.CharField(required=False, max_length=64)
        project_id = serializers.CharField(required=False, max_length=64)
        model = serializers.CharField(required=False, max_length=200)
        client_request_id = serializers.CharField(required=False, max_length=128)
        after = serializers.CharField(required=False, max_length=128, help_text="The last id of the page before.")
        limit = serializers.IntegerField(required=False, min_value=1, max_value=MAX_REQUEST_LOG_PAGE, default=20)

    class RequestLogOutputSerializer(serializers.Serializer):
        object = serializers.ChoiceField(choices=["list"])
        data = RequestTimelineOutputSerializer(many=True)
        first_id = serializers.CharField(allow_null=True)
        last_id = serializers.CharField(allow_null=True)
        has_more = serializers.BooleanField()

    @extend_schema(parameters=[RequestLogFilterSerializer], responses=RequestLogOutputSerializer)
    def get(self, request: Request) -> Response:
        filters = self.RequestLogFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        page = request_log(organization=self.organization, **filters.validated_data)
        ids = [timeline.request_id for timeline in page.items]
        body = {
            "object": "list",
            "data": page.items,
            "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None,
            "has_more": page.has_more,
        }
        return Response(self.RequestLogOutputSerializer(body).data)


class LatencyPercentilesOutputSerializer(serializers.Serializer):
    p50 = serializers.FloatField()
    p90 = serializers.FloatField()
    p99 = serializers.FloatField()


class LatencyApi(TenantAPIView):
    """Percentiles of time to first token and of total duration per day (UTC) and model, from the ledger."""

    required_permissions = {"GET": Permission.USAGE_READ}

    class LatencyFilterSerializer(DayRangeFilterSerializer):
        model = serializers.CharField(required=False, max_length=200)
        api_key_id = serializers.CharField(required=False, max_length=64)
        project_id = serializers.CharField(required=False, max_length=64)

    class LatencyOutputSerializer(serializers.Serializer):
        class LatencyRowSerializer(serializers.Serializer):
            day = serializers.DateField()
            model = serializers.CharField()
            requests = serializers.IntegerField(help_text="Requests with a prefill phase that started that day.")
            time_to_first_token_ms = LatencyPercentilesOutputSerializer(
                help_text="p50, p90, p99 of the prefill phase's wall time (the gateway's Prefill call to the first "
                "token back, queueing included).",
            )
            duration_ms = LatencyPercentilesOutputSerializer(
                help_text="p50, p90, p99 of the time from the prefill's start to the decode's end.",
            )

        object = serializers.ChoiceField(choices=["list"])
        data = LatencyRowSerializer(many=True)

    @extend_schema(parameters=[LatencyFilterSerializer], responses=LatencyOutputSerializer)
    def get(self, request: Request) -> Response:
        filters = self.LatencyFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        rows = latency_percentiles_daily(organization=self.organization, **filters.validated_data)
        return Response(self.LatencyOutputSerializer({"object": "list", "data": rows}).data)
