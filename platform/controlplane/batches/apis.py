"""The Batch API's endpoints, in OpenAI's shapes (`/files`, `/batches`); the gateway serves them at `/v1/`
by forwarding each call here with the caller's API key."""

import calendar
from datetime import datetime

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.batches.jsonl import ENDPOINTS
from controlplane.batches.models import Batch, File, FilePurpose
from controlplane.batches.selectors import (
    batch_get,
    batch_list,
    batch_of_runner_key,
    batch_usage,
    file_get,
    file_list,
    request_counts,
)
from controlplane.batches.services import (
    COMPLETION_WINDOWS,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    batch_cancel,
    batch_create,
    file_delete,
    file_upload,
)
from controlplane.common.pagination import CursorQuerySerializer, cursor_list_response
from controlplane.tenancy.access import Permission, Principal
from controlplane.tenancy.base_apis import TenantAPIView


def unix(moment: datetime) -> int:
    return calendar.timegm(moment.utctimetuple())


class FileOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    object = serializers.SerializerMethodField()
    bytes = serializers.IntegerField()
    created_at = serializers.SerializerMethodField()
    filename = serializers.CharField()
    purpose = serializers.CharField()
    status = serializers.SerializerMethodField()
    status_details = serializers.SerializerMethodField()

    def get_object(self, file: File) -> str:
        return "file"

    def get_created_at(self, file: File) -> int:
        return unix(file.created_at)

    def get_status(self, file: File) -> str:
        return "processed"

    @extend_schema_field({"type": "string", "nullable": True, "description": "Always null (OpenAI's shape)."})
    def get_status_details(self, file: File) -> None:
        return None


@extend_schema_field(OpenApiTypes.INT)
class UnixTimeField(serializers.Field):
    """A moment as OpenAI's objects carry it: whole seconds since the epoch, or null (allow_null=True)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(read_only=True, **kwargs)

    def to_representation(self, value: datetime) -> int:
        return unix(value)

    def get_attribute(self, instance):
        return getattr(instance, self.source)


class BatchUsageSerializer(serializers.Serializer):
    """OpenAI's batch `usage`."""

    class InputTokensDetailsSerializer(serializers.Serializer):
        cached_tokens = serializers.IntegerField()

    class OutputTokensDetailsSerializer(serializers.Serializer):
        reasoning_tokens = serializers.IntegerField()

    input_tokens = serializers.IntegerField()
    input_tokens_details = InputTokensDetailsSerializer(source="*")
    output_tokens = serializers.IntegerField()
    output_tokens_details = OutputTokensDetailsSerializer(source="*")
    total_tokens = serializers.IntegerField()


class BatchOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    object = serializers.SerializerMethodField()
    endpoint = serializers.CharField()
    errors = serializers.JSONField()
    input_file_id = serializers.CharField()
    completion_window = serializers.CharField()
    status = serializers.CharField()
    output_file_id = serializers.CharField(source="output_file.public_id", default=None, allow_null=True)
    error_file_id = serializers.CharField(source="error_file.public_id", default=None, allow_null=True)
    created_at = UnixTimeField()
    in_progress_at = UnixTimeField(allow_null=True)
    expires_at = UnixTimeField()
    finalizing_at = UnixTimeField(allow_null=True)
    completed_at = UnixTimeField(allow_null=True)
    failed_at = UnixTimeField(allow_null=True)
    expired_at = UnixTimeField(allow_null=True)
    cancelling_at = UnixTimeField(allow_null=True)
    cancelled_at = UnixTimeField(allow_null=True)
    request_counts = serializers.SerializerMethodField()
    usage = serializers.SerializerMethodField()
    metadata = serializers.JSONField()

    def get_object(self, batch: Batch) -> str:
        return "batch"

    def get_request_counts(self, batch: Batch) -> dict:
        counts = request_counts(batch=batch)
        return {"total": counts.total, "completed": counts.completed, "failed": counts.failed}

    @extend_schema_field(BatchUsageSerializer)
    def get_usage(self, batch: Batch) -> dict:
        return BatchUsageSerializer(batch_usage(batch=batch)).data


class CursorListSerializer(serializers.Serializer):
    """OpenAI's list envelope: newest first; the next page starts `after` the `last_id`."""

    object = serializers.CharField()
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class FileListOutputSerializer(CursorListSerializer):
    data = FileOutputSerializer(many=True)


class BatchListOutputSerializer(CursorListSerializer):
    data = BatchOutputSerializer(many=True)


class FileDeletedOutputSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    deleted = serializers.BooleanField()


class NotABatchRunner(BasePermission):
    """A batch's runner key sends that batch's lines through the gateway, and nothing else: not even its
    organization's files and batches (the only part of this API its inference scope would reach)."""

    message = "This API key is a batch's runner key: it only sends the lines of its batch, through the gateway."

    def has_permission(self, request: Request, view: APIView) -> bool:
        api_key = getattr(request.user, "api_key", None)
        return api_key is None or batch_of_runner_key(api_key=api_key) is None


class BatchApiView(TenantAPIView):
    permission_classes = [*TenantAPIView.permission_classes, NotABatchRunner]


class FileListCreateApi(BatchApiView):
    required_permissions = {"GET": Permission.BATCHES_READ, "POST": Permission.BATCHES_WRITE}
    parser_classes = [MultiPartParser, FormParser]

    class FileUploadInputSerializer(serializers.Serializer):
        file = serializers.FileField(allow_empty_file=True)
        purpose = serializers.ChoiceField(
            choices=[FilePurpose.BATCH],
            error_messages={"invalid_choice": "purpose is {input!r}; only 'batch' files can be uploaded here."},
        )

    class FileListQuerySerializer(CursorQuerySerializer):
        purpose = serializers.CharField(required=False, max_length=32)

    @extend_schema(parameters=[FileListQuerySerializer], responses=FileListOutputSerializer)
    def get(self, request: Request) -> Response:
        query = self.FileListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        files = file_list(organization=self.organization, purpose=query.validated_data.get("purpose"))
        return cursor_list_response(files, FileOutputSerializer, request)

    @extend_schema(request=FileUploadInputSerializer, responses={200: FileOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.FileUploadInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        upload = serializer.validated_data["file"]
        file = file_upload(
            organization=self.organization,
            filename=upload.name or "",
            content=upload.read(),
            purpose=serializer.validated_data["purpose"],
        )
        return Response(FileOutputSerializer(file).data)


class FileDetailApi(BatchApiView):
    required_permissions = {"GET": Permission.BATCHES_READ, "DELETE": Permission.BATCHES_WRITE}

    @extend_schema(responses=FileOutputSerializer)
    def get(self, request: Request, file_id: str) -> Response:
        return Response(FileOutputSerializer(file_get(organization=self.organization, public_id=file_id)).data)

    @extend_schema(responses={200: FileDeletedOutputSerializer})
    def delete(self, request: Request, file_id: str) -> Response:
        file_delete(file=file_get(organization=self.organization, public_id=file_id))
        return Response({"id": file_id, "object": "file", "deleted": True})


class FileContentApi(BatchApiView):
    required_permissions = {"GET": Permission.BATCHES_READ}

    @extend_schema(responses={(200, "application/jsonl"): bytes})
    def get(self, request: Request, file_id: str) -> HttpResponse:
        file = file_get(organization=self.organization, public_id=file_id)
        return HttpResponse(bytes(file.content), content_type="application/jsonl")


@extend_schema_field(
    {
        "type": "object",
        "nullable": True,
        "maxProperties": MAX_METADATA_PAIRS,
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        "description": f"Up to {MAX_METADATA_PAIRS} pairs of strings, keys of at most {MAX_METADATA_KEY} characters.",
    }
)
class MetadataField(serializers.JSONField):
    """A batch's metadata, checked by `batch_create`."""


class BatchListCreateApi(BatchApiView):
    required_permissions = {"GET": Permission.BATCHES_READ, "POST": Permission.BATCHES_WRITE}

    class BatchCreateInputSerializer(serializers.Serializer):
        input_file_id = serializers.CharField(max_length=64)
        endpoint = serializers.ChoiceField(
            choices=ENDPOINTS,
            error_messages={"invalid_choice": f"endpoint is {{input!r}}; use one of {', '.join(ENDPOINTS)}."},
        )
        completion_window = serializers.ChoiceField(
            choices=sorted(COMPLETION_WINDOWS),
            error_messages={"invalid_choice": "completion_window is {input!r}; only '24h' is supported."},
        )
        metadata = MetadataField(required=False, allow_null=True, default=None)

    @extend_schema(parameters=[CursorQuerySerializer], responses=BatchListOutputSerializer)
    def get(self, request: Request) -> Response:
        return cursor_list_response(batch_list(organization=self.organization), BatchOutputSerializer, request)

    @extend_schema(request=BatchCreateInputSerializer, responses={200: BatchOutputSerializer})
    def post(self, request: Request) -> Response:
        serializer = self.BatchCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        api_key = request.user.api_key if isinstance(request.user, Principal) else None
        project = api_key.project if api_key is not None else None
        batch = batch_create(organization=self.organization, project=project, **serializer.validated_data)
        return Response(
            BatchOutputSerializer(batch_get(organization=self.organization, public_id=batch.public_id)).data
        )


class BatchDetailApi(BatchApiView):
    required_permissions = {"GET": Permission.BATCHES_READ}

    @extend_schema(responses=BatchOutputSerializer)
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(BatchOutputSerializer(batch_get(organization=self.organization, public_id=batch_id)).data)


class BatchCancelApi(BatchApiView):
    required_permissions = {"POST": Permission.BATCHES_WRITE}

    @extend_schema(request=None, responses=BatchOutputSerializer)
    def post(self, request: Request, batch_id: str) -> Response:
        batch = batch_cancel(batch=batch_get(organization=self.organization, public_id=batch_id))
        return Response(
            BatchOutputSerializer(batch_get(organization=self.organization, public_id=batch.public_id)).data
        )
