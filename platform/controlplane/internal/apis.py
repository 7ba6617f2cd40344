"""The endpoints the gateway and the command line (internal token) and the workers (fleet token) call, under
`internal/`.

Each view translates HTTP to one call of a domain app's service or selector and back; the callers' side
of each endpoint and message is diptych_common/internal_api/ (tests/platform/test_platform_internal_contracts.py
checks that the two agree).
"""

from dataclasses import asdict
from datetime import timedelta

from django.conf import settings
from django.http import StreamingHttpResponse
from django.urls import reverse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.batches.selectors import batch_of_runner_key
from controlplane.billing.selectors import project_spend_status, spend_status
from controlplane.billing.services import usage_events_ingest
from controlplane.catalog.artifact_store import ArtifactNotFound, artifact_key, artifact_store
from controlplane.catalog.models import REVISION_MAX_LENGTH, ModelFile, WorkerState
from controlplane.catalog.selectors import (
    fleet_model_file_get,
    model_file_get,
    model_list,
    model_manifest,
    worker_list_live,
)
from controlplane.catalog.services import (
    WorkerLoad,
    model_register,
    worker_heartbeat,
    worker_register,
    worker_rpc_secret,
)
from controlplane.common.errors import ObjectNotFound
from controlplane.common.strict_input import TextField
from controlplane.idempotency.services import (
    idempotency_key_claim,
    idempotency_key_complete,
    idempotency_key_release,
)
from controlplane.internal.base_apis import FleetAPIView, InternalAPIView
from controlplane.internal.serializers import (
    ADDRESS_MESSAGE,
    ADDRESS_PATTERN,
    ArtifactManifestSerializer,
    IdempotencyKeyFields,
    LimitsSerializer,
    RefusalReportSerializer,
    UsageEventSerializer,
)
from controlplane.metering.services import MAX_EVENTS_PER_BATCH, rate_limit_refusals_record
from controlplane.tenancy.selectors import organization_get
from controlplane.tenancy.services import api_key_authenticate
from controlplane.webhooks.models import EventType
from controlplane.webhooks.services import emit_event
from diptych_common.internal_api import messages

MAX_POSITIVE_INTEGER = 2**31 - 1


def _folder_url(file_route: str, model: str, revision: str) -> str:
    """The URL of a revision's folder: the URL of a file in it without the file's name."""
    return reverse(file_route, kwargs={"model": model, "revision": revision, "path": "-"}).removesuffix("-")


def _stream_model_file(model_file: ModelFile) -> StreamingHttpResponse:
    model, revision = model_file.model.name, model_file.revision
    try:
        chunks = artifact_store().open(artifact_key(model=model, revision=revision, path=model_file.path))
    except ArtifactNotFound:
        raise ObjectNotFound(
            f"File {model_file.path!r} of revision {revision!r} of model {model!r} is missing from the artifact store."
        ) from None
    response = StreamingHttpResponse(chunks, content_type="application/octet-stream")
    response["Content-Length"] = str(model_file.size)
    response["X-Content-SHA256"] = model_file.sha256
    return response


MODEL_FILE_RESPONSE = {
    (200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY, description="The file's bytes.")
}


class FileContentNegotiation(BaseContentNegotiation):
    """A file goes out as bytes, an error as JSON, whatever the Accept header asks (`application/octet-stream`
    would otherwise be refused with 406, JSON being the only renderer)."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return JSONRenderer(), JSONRenderer.media_type


# ---- called by the gateway ------------------------------------------------------------------------------


class ApiKeyVerifyApi(InternalAPIView):
    class ApiKeyVerifyInputSerializer(serializers.Serializer):
        api_key = serializers.CharField(trim_whitespace=False)

    class ApiKeyVerifyOutputSerializer(serializers.Serializer):
        class VerifyLimitsSerializer(serializers.Serializer):
            organization = LimitsSerializer()
            project = LimitsSerializer()
            api_key = LimitsSerializer()

        class SpendSerializer(serializers.Serializer):
            limit_micros = serializers.IntegerField(allow_null=True)
            spent_micros = serializers.IntegerField()
            over_limit = serializers.BooleanField()

        api_key_id = serializers.CharField()
        organization_id = serializers.CharField()
        project_id = serializers.CharField()
        kind = serializers.ChoiceField(
            choices=["standard", "batch"], help_text="batch: a batch's runner key; its usage is billed at batch prices."
        )
        batch_id = serializers.CharField(
            allow_null=True, help_text="The batch of a runner key: the key sends that batch's lines and nothing else."
        )
        scopes = serializers.ListField(child=serializers.CharField())
        expires_at = serializers.DateTimeField(allow_null=True)
        limits = VerifyLimitsSerializer()
        spend = SpendSerializer()
        project_spend = SpendSerializer(help_text="The project's spend limit and spend in the open period.")

    @extend_schema(request=ApiKeyVerifyInputSerializer, responses=ApiKeyVerifyOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.ApiKeyVerifyInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        api_key = api_key_authenticate(key=serializer.validated_data["api_key"])
        organization = api_key.organization
        batch = batch_of_runner_key(api_key=api_key)
        verified = {
            "api_key_id": api_key.public_id,
            "organization_id": organization.public_id,
            "project_id": api_key.project.public_id,
            "kind": "standard" if batch is None else "batch",
            "batch_id": None if batch is None else batch.public_id,
            "scopes": api_key.scopes,
            "expires_at": api_key.expires_at,
            "limits": {"organization": organization, "project": api_key.project, "api_key": api_key},
            "spend": spend_status(organization=organization),
            "project_spend": project_spend_status(project=api_key.project),
        }
        return Response(self.ApiKeyVerifyOutputSerializer(verified).data)


class RegistryApi(InternalAPIView):
    class RegistryOutputSerializer(serializers.Serializer):
        class RegistryModelSerializer(serializers.Serializer):
            name = serializers.CharField()
            source = serializers.CharField()
            context_length = serializers.IntegerField()
            revision = serializers.CharField(source="published_revision")  # "" unless published as artifacts
            created_at = serializers.DateTimeField()

        class RegistryWorkerSerializer(serializers.Serializer):
            id = serializers.CharField(source="public_id")
            name = serializers.CharField()
            role = serializers.CharField(source="fleet.role")
            model = serializers.CharField(source="fleet.model.name")
            region = serializers.CharField(source="fleet.region")
            hardware_class = serializers.CharField(source="fleet.hardware_class")
            address = serializers.CharField()
            state = serializers.CharField()
            queue_depth = serializers.IntegerField()
            active_sequences = serializers.IntegerField()
            kv_blocks_free = serializers.IntegerField()
            kv_blocks_total = serializers.IntegerField()
            tokens_per_second = serializers.FloatField()
            last_heartbeat_at = serializers.DateTimeField()
            revision = serializers.CharField(help_text="The model revision the worker loaded; empty when none.")

        models = RegistryModelSerializer(many=True)
        workers = RegistryWorkerSerializer(many=True)

    @extend_schema(responses=RegistryOutputSerializer)
    def get(self, request: Request) -> Response:
        registry = {"models": model_list(), "workers": worker_list_live(now=timezone.now())}
        return Response(self.RegistryOutputSerializer(registry).data)


class WorkerCredentialApi(InternalAPIView):
    """The worker RPC secret, for the gateway: it carries it on every call to a worker."""

    class WorkerCredentialOutputSerializer(serializers.Serializer):
        worker_rpc_secret = serializers.CharField()

    @extend_schema(responses=WorkerCredentialOutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(self.WorkerCredentialOutputSerializer({"worker_rpc_secret": worker_rpc_secret()}).data)


class UsageEventIngestApi(InternalAPIView):
    class UsageEventBatchInputSerializer(serializers.Serializer):
        events = UsageEventSerializer(many=True, allow_empty=True, max_length=MAX_EVENTS_PER_BATCH)

    class UsageEventBatchOutputSerializer(serializers.Serializer):
        accepted = serializers.IntegerField()
        duplicates = serializers.IntegerField()

    @extend_schema(request=UsageEventBatchInputSerializer, responses=UsageEventBatchOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.UsageEventBatchInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        # The validated events as wire bodies again (defaults filled in, times in UTC), one message each.
        reports = [messages.UsageEvent.from_wire(event) for event in serializer.data["events"]]
        result = usage_events_ingest(reports=reports)
        return Response(self.UsageEventBatchOutputSerializer(asdict(result)).data)


class RateLimitRefusalIngestApi(InternalAPIView):
    """The gateway's counts of requests refused by a rate limit, per minute, key and limit, in batches."""

    class RefusalBatchInputSerializer(serializers.Serializer):
        refusals = RefusalReportSerializer(many=True, allow_empty=True, max_length=MAX_EVENTS_PER_BATCH)

    @extend_schema(request=RefusalBatchInputSerializer, responses=UsageEventIngestApi.UsageEventBatchOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.RefusalBatchInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        # The validated reports as wire bodies again (times in UTC), one message each.
        reports = [messages.RefusalReport.from_wire(row) for row in serializer.data["refusals"]]
        result = rate_limit_refusals_record(reports=reports)
        return Response(UsageEventIngestApi.UsageEventBatchOutputSerializer(asdict(result)).data)


class IdempotencyKeyClaimApi(InternalAPIView):
    """The gateway asks before it runs a request that carries an idempotency key."""

    class IdempotencyKeyClaimInputSerializer(IdempotencyKeyFields):
        caller = serializers.CharField(
            max_length=160, help_text="The API key that sends the request: only it gets the stored response."
        )
        fingerprint = serializers.CharField(max_length=64)
        lease_seconds = serializers.IntegerField(min_value=1, max_value=24 * 3600)

    class IdempotencyKeyClaimOutputSerializer(serializers.Serializer):
        outcome = serializers.ChoiceField(choices=["claimed", "in_flight", "completed", "mismatch", "other_caller"])
        execution_id = serializers.CharField()
        response = serializers.JSONField(allow_null=True)

    @extend_schema(request=IdempotencyKeyClaimInputSerializer, responses=IdempotencyKeyClaimOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.IdempotencyKeyClaimInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        claim = idempotency_key_claim(
            organization_id=data["organization_id"],
            key=data["key"],
            caller=data["caller"],
            fingerprint=data["fingerprint"],
            execution_id=data["execution_id"],
            lease=timedelta(seconds=data["lease_seconds"]),
        )
        return Response(self.IdempotencyKeyClaimOutputSerializer(asdict(claim)).data)


class IdempotencyKeyCompleteApi(InternalAPIView):
    class IdempotencyKeyCompleteInputSerializer(IdempotencyKeyFields):
        response = serializers.JSONField()

    class IdempotencyKeyCompleteOutputSerializer(serializers.Serializer):
        stored = serializers.BooleanField(help_text="False when the execution no longer holds the key.")

    @extend_schema(request=IdempotencyKeyCompleteInputSerializer, responses=IdempotencyKeyCompleteOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.IdempotencyKeyCompleteInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        stored = idempotency_key_complete(**serializer.validated_data)
        return Response(self.IdempotencyKeyCompleteOutputSerializer({"stored": stored}).data)


class IdempotencyKeyReleaseApi(InternalAPIView):
    class IdempotencyKeyReleaseOutputSerializer(serializers.Serializer):
        released = serializers.BooleanField(help_text="False when the execution no longer holds the key.")

    @extend_schema(request=IdempotencyKeyFields, responses=IdempotencyKeyReleaseOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = IdempotencyKeyFields(data=request.data)
        serializer.is_valid(raise_exception=True)
        released = idempotency_key_release(**serializer.validated_data)
        return Response(self.IdempotencyKeyReleaseOutputSerializer({"released": released}).data)


RESPONSE_EVENT_TYPES = [event_type for event_type in EventType.values if event_type.startswith("response.")]


class WebhookEventEmitApi(InternalAPIView):
    """An event the gateway saw happen to a response (it keeps responses), sent to the organization's
    webhook endpoints that subscribe to it. Emitting the same event about the same response again changes
    nothing, so the gateway may retry a call whose answer it lost."""

    class WebhookEventInputSerializer(serializers.Serializer):
        class WebhookEventDataSerializer(serializers.Serializer):
            id = TextField(max_length=64, help_text="The response's id (resp_...).")

        organization_id = TextField(max_length=64)
        type = serializers.ChoiceField(choices=RESPONSE_EVENT_TYPES)
        data = WebhookEventDataSerializer()

    class WebhookEventOutputSerializer(serializers.Serializer):
        event_id = serializers.CharField(allow_null=True, help_text="Null: no endpoint subscribes to the type.")

    @extend_schema(request=WebhookEventInputSerializer, responses=WebhookEventOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.WebhookEventInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        event = emit_event(
            organization=organization_get(public_id=data["organization_id"]),
            event_type=data["type"],
            data={"id": data["data"]["id"]},
        )
        event_id = None if event is None else event.public_id
        return Response(self.WebhookEventOutputSerializer({"event_id": event_id}).data)


class ModelArtifactManifestApi(InternalAPIView):
    """A model's manifest for the gateway, which loads the tokenizer of a model published as artifacts."""

    @extend_schema(responses=ArtifactManifestSerializer)
    def get(self, request: Request, model: str) -> Response:
        manifest = model_manifest(
            name=model, files_url=lambda revision: _folder_url("internal-model-artifact-file", model, revision)
        )
        return Response(ArtifactManifestSerializer(manifest).data)


class ModelArtifactFileApi(InternalAPIView):
    content_negotiation_class = FileContentNegotiation

    @extend_schema(responses=MODEL_FILE_RESPONSE)
    def get(self, request: Request, model: str, revision: str, path: str) -> StreamingHttpResponse:
        return _stream_model_file(model_file_get(model=model, revision=revision, path=path))


# ---- called by the command line (`diptych model register`) ----------------------------------------------


class ModelRegisterApi(InternalAPIView):
    """A model directory into the catalog: the model and its prefill, decode and colocated fleets, and its
    files published as a revision, which the model's workers then load. Registering the same files again
    changes nothing but making their revision current; other files under a published revision are refused."""

    parser_classes = [MultiPartParser]
    max_body_bytes = None  # a model's files, as large as they come: each streams to disk, not memory

    class ModelRegisterInputSerializer(serializers.Serializer):
        name = serializers.RegexField(
            messages.MODEL_NAME_PATTERN, error_messages={"invalid": f"Not allowed: {messages.MODEL_NAME_RULE}."}
        )
        context_length = serializers.IntegerField(min_value=1, max_value=MAX_POSITIVE_INTEGER)
        family = serializers.CharField(max_length=50, help_text="The config's model_type, e.g. llama.")
        dtype = serializers.CharField(max_length=20)
        revision = serializers.CharField(
            max_length=REVISION_MAX_LENGTH,
            required=False,
            default="",
            allow_blank=True,
            help_text="Empty: named by the files' content (12 hex digits of the sha256 of their list).",
        )
        paths = serializers.ListField(
            child=serializers.CharField(max_length=1000, trim_whitespace=False),
            allow_empty=False,
            help_text="Each file's POSIX path in the model directory, in the order of `files`.",
        )
        files = serializers.ListField(child=serializers.FileField(allow_empty_file=True), allow_empty=False)

        def validate(self, attrs: dict) -> dict:
            if len(attrs["paths"]) != len(attrs["files"]):
                raise serializers.ValidationError(
                    {"paths": [f"One path per file, in their order: {len(attrs['paths'])} for {len(attrs['files'])}."]}
                )
            return attrs

    class ModelRegisterOutputSerializer(serializers.Serializer):
        name = serializers.CharField(source="model.name")
        context_length = serializers.IntegerField(source="model.context_length")
        revision = serializers.CharField(help_text="The model's current revision, which its workers load.")
        fleet_tokens = serializers.DictField(
            child=serializers.CharField(),
            help_text="Role -> a fresh fleet token (the fleet's earlier one stops working); empty when the model's "
            "fleets already held tokens, which they keep.",
        )

    @extend_schema(request=ModelRegisterInputSerializer, responses=ModelRegisterOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = self.ModelRegisterInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        registered = model_register(
            name=data["name"],
            context_length=data["context_length"],
            family=data["family"],
            dtype=data["dtype"],
            revision=data["revision"],
            files=list(zip(data["paths"], data["files"], strict=True)),
        )
        return Response(self.ModelRegisterOutputSerializer(registered).data)


# ---- called by the workers ------------------------------------------------------------------------------


class WorkerRegisterApi(FleetAPIView):
    class WorkerRegisterInputSerializer(serializers.Serializer):
        address = serializers.RegexField(ADDRESS_PATTERN, max_length=300, error_messages={"invalid": ADDRESS_MESSAGE})
        name = TextField(max_length=100)
        revision = TextField(
            max_length=REVISION_MAX_LENGTH,
            required=False,
            default="",
            allow_blank=True,
            help_text="The published revision of the fleet's model the worker loaded; empty for builtin or local.",
        )

    class WorkerRegisterOutputSerializer(serializers.Serializer):
        class FleetSummarySerializer(serializers.Serializer):
            name = serializers.CharField()
            role = serializers.CharField()
            model = serializers.CharField(source="model.name")
            region = serializers.CharField()
            hardware_class = serializers.CharField()

        id = serializers.CharField(source="public_id")
        fleet = FleetSummarySerializer()
        heartbeat_interval_seconds = serializers.SerializerMethodField()
        worker_rpc_secret = serializers.SerializerMethodField(
            help_text="What every call to a worker must carry as `authorization: Bearer <secret>`."
        )

        def get_heartbeat_interval_seconds(self, worker) -> int:
            return settings.DIPTYCH_HEARTBEAT_INTERVAL_SECONDS

        def get_worker_rpc_secret(self, worker) -> str:
            return worker_rpc_secret()

    @extend_schema(request=WorkerRegisterInputSerializer, responses={201: WorkerRegisterOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.WorkerRegisterInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        worker = worker_register(fleet=self.fleet, **serializer.validated_data)
        return Response(self.WorkerRegisterOutputSerializer(worker).data, status=status.HTTP_201_CREATED)


class WorkerHeartbeatApi(FleetAPIView):
    class WorkerHeartbeatInputSerializer(serializers.Serializer):
        state = serializers.ChoiceField(choices=[WorkerState.READY, WorkerState.DRAINING])
        queue_depth = serializers.IntegerField(min_value=0, max_value=MAX_POSITIVE_INTEGER, default=0)
        active_sequences = serializers.IntegerField(min_value=0, max_value=MAX_POSITIVE_INTEGER, default=0)
        kv_blocks_free = serializers.IntegerField(min_value=0, max_value=MAX_POSITIVE_INTEGER, default=0)
        kv_blocks_total = serializers.IntegerField(min_value=0, max_value=MAX_POSITIVE_INTEGER, default=0)
        tokens_per_second = serializers.FloatField(min_value=0, default=0.0)

        def validate(self, attrs: dict) -> dict:
            if attrs["kv_blocks_free"] > attrs["kv_blocks_total"]:
                raise serializers.ValidationError({"kv_blocks_free": ["Cannot exceed kv_blocks_total."]})
            return attrs

    class WorkerHeartbeatOutputSerializer(serializers.Serializer):
        state = serializers.CharField()

    @extend_schema(request=WorkerHeartbeatInputSerializer, responses=WorkerHeartbeatOutputSerializer)
    def post(self, request: Request, worker_id: str) -> Response:
        serializer = self.WorkerHeartbeatInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        state = serializer.validated_data.pop("state")
        worker = worker_heartbeat(
            fleet=self.fleet, worker_id=worker_id, state=state, load=WorkerLoad(**serializer.validated_data)
        )
        return Response(self.WorkerHeartbeatOutputSerializer(worker).data)


class ArtifactManifestApi(FleetAPIView):
    """What the calling fleet's workers load: the model's current revision, its files and their store."""

    @extend_schema(responses=ArtifactManifestSerializer)
    def get(self, request: Request) -> Response:
        model = self.fleet.model.name
        manifest = model_manifest(
            name=model, files_url=lambda revision: _folder_url("internal-artifact-file", model, revision)
        )
        return Response(ArtifactManifestSerializer(manifest).data)


class ArtifactFileApi(FleetAPIView):
    """One published file of the calling fleet's model, streamed from the artifact store."""

    content_negotiation_class = FileContentNegotiation

    @extend_schema(responses=MODEL_FILE_RESPONSE)
    def get(self, request: Request, model: str, revision: str, path: str) -> StreamingHttpResponse:
        return _stream_model_file(fleet_model_file_get(fleet=self.fleet, model=model, revision=revision, path=path))
