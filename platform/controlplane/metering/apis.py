from dataclasses import asdict
from datetime import timedelta

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.common.base_apis import InternalAPIView
from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.pagination import PaginatedListMixin
from controlplane.metering.models import Phase
from controlplane.metering.selectors import usage_event_list, usage_summary
from controlplane.metering.services import (
    MAX_EVENTS_PER_BATCH,
    UsageReport,
    idempotency_key_claim,
    idempotency_key_complete,
    idempotency_key_release,
    usage_events_ingest,
)
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView

MAX_BIG_INTEGER = 2**63 - 1


EXECUTION_ID_PATTERN = r"^exec_[0-9a-f]{32}$"
CLIENT_REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:-]{0,128}$"


class UsageReportSerializer(serializers.Serializer):
    request_id = serializers.CharField(max_length=128, help_text="The execution's server-issued id.")
    client_request_id = serializers.RegexField(CLIENT_REQUEST_ID_PATTERN, required=False, default="", allow_blank=True)
    phase = serializers.ChoiceField(choices=Phase.choices)
    organization_id = serializers.CharField(max_length=32)
    api_key_id = serializers.CharField(max_length=32)
    model = serializers.CharField(max_length=200)
    region = serializers.CharField(max_length=64)
    worker_id = serializers.CharField(max_length=64)
    tokens = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    cached_tokens = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    kv_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    compute_ms = serializers.IntegerField(min_value=0, max_value=MAX_BIG_INTEGER)
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()

    def validate(self, attrs: dict) -> dict:
        if attrs["cached_tokens"] > attrs["tokens"]:
            raise serializers.ValidationError({"cached_tokens": ["Cannot exceed tokens."]})
        if attrs["started_at"] > attrs["finished_at"]:
            raise serializers.ValidationError({"finished_at": ["Cannot be before started_at."]})
        return attrs


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


class UsageSummaryRowSerializer(serializers.Serializer):
    model = serializers.CharField()
    phase = serializers.CharField()
    requests = serializers.IntegerField()
    tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()


class UsageEventIngestApi(InternalAPIView):
    class UsageEventBatchInputSerializer(serializers.Serializer):
        events = UsageReportSerializer(many=True, allow_empty=True, max_length=MAX_EVENTS_PER_BATCH)

    class UsageEventBatchOutputSerializer(serializers.Serializer):
        accepted = serializers.IntegerField()
        duplicates = serializers.IntegerField()

    @extend_schema(request=UsageEventBatchInputSerializer, responses=UsageEventBatchOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.UsageEventBatchInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        reports = [UsageReport(**event) for event in serializer.validated_data["events"]]
        result = usage_events_ingest(reports=reports)
        return Response(self.UsageEventBatchOutputSerializer(asdict(result)).data)


class UsageEventListApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.USAGE_READ}

    class UsageEventFilterSerializer(QueryFilterSerializer):
        request_id = serializers.CharField(required=False)
        client_request_id = serializers.CharField(required=False)
        phase = serializers.ChoiceField(choices=Phase.choices, required=False)
        model = serializers.CharField(required=False)

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

    @extend_schema(responses=UsageSummaryRowSerializer(many=True))
    def get(self, request: Request) -> Response:
        rows = usage_summary(organization=self.organization)
        return Response(UsageSummaryRowSerializer(rows, many=True).data)


class IdempotencyKeyFields(serializers.Serializer):
    organization_id = serializers.CharField(max_length=32)
    key = serializers.CharField(max_length=255)
    execution_id = serializers.RegexField(EXECUTION_ID_PATTERN)


class IdempotencyKeyClaimApi(InternalAPIView):
    """The gateway asks before it runs a request that carries an idempotency key."""

    class InputSerializer(IdempotencyKeyFields):
        fingerprint = serializers.CharField(max_length=64)
        lease_seconds = serializers.IntegerField(min_value=1, max_value=24 * 3600)

    class OutputSerializer(serializers.Serializer):
        outcome = serializers.ChoiceField(choices=["claimed", "in_flight", "completed", "mismatch"])
        execution_id = serializers.CharField()
        response = serializers.JSONField(allow_null=True)

    @extend_schema(request=InputSerializer, responses=OutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        claim = idempotency_key_claim(
            organization_id=data["organization_id"], key=data["key"], fingerprint=data["fingerprint"],
            execution_id=data["execution_id"], lease=timedelta(seconds=data["lease_seconds"]),
        )
        return Response(self.OutputSerializer(asdict(claim)).data)


class IdempotencyKeyCompleteApi(InternalAPIView):
    class InputSerializer(IdempotencyKeyFields):
        response = serializers.JSONField()

    @extend_schema(request=InputSerializer, responses={200: None})
    def post(self, request: Request) -> Response:
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        stored = idempotency_key_complete(**serializer.validated_data)
        return Response({"stored": stored})


class IdempotencyKeyReleaseApi(InternalAPIView):
    @extend_schema(request=IdempotencyKeyFields, responses={200: None})
    def post(self, request: Request) -> Response:
        serializer = IdempotencyKeyFields(data=request.data)
        serializer.is_valid(raise_exception=True)
        released = idempotency_key_release(**serializer.validated_data)
        return Response({"released": released})
