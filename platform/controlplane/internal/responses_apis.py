"""The gateway's endpoints for stored responses (`/v1/responses`), under `internal/responses`: store (create or
update), fetch with the conversation's token ids, status, delete, cancel and list the input items. Each names
the organization that owns the response; another organization's id is a 404, as a missing one is.

Token ids travel as JSON lists of integers and are kept as little-endian uint32s."""

import struct
from datetime import UTC, datetime

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.common.filters import QueryFilterSerializer
from controlplane.common.strict_input import StrictInputSerializer, TextField
from controlplane.internal.base_apis import InternalAPIView
from controlplane.responses.models import RESPONSE_ID_MAX_LENGTH, ResponseStatus, StoredResponse
from controlplane.responses.selectors import MAX_PAGE, input_item_page, response_get, response_status_get
from controlplane.responses.services import ResponseContent, response_cancel, response_delete, response_store
from controlplane.tenancy.selectors import organization_get

MAX_UNIX_SECONDS = 2**36  # the year 4147: created_at plus the retention stays a date
MAX_TOKEN_ID = 2**32 - 1
RESPONSE_ID_PATTERN = rf"^resp_[0-9A-Za-z]{{1,{RESPONSE_ID_MAX_LENGTH - 5}}}$"
PUBLIC_ID_PATTERN = r"^[a-z]{1,8}_[0-9A-Za-z]{1,27}$"  # the control plane's public ids (common/ids.py)
MODEL_PATTERN = r"^[\x21-\x7e]{1,200}$"
ITEM_ID_PATTERN = r"^[\x21-\x7e]{1,64}$"  # as the gateway takes an input item's id


class PatternTextField(TextField):
    """Text sent as a JSON string, matching `pattern` (which the schema states)."""

    def __init__(self, pattern: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.validators.append(RegexValidator(pattern, message=f"Must match {pattern}."))


@extend_schema_field({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}})
class TokenIdsField(serializers.Field):
    """Token ids: a JSON list of integers on the wire, little-endian uint32s in the database."""

    default_error_messages = {"not_token_ids": "Must be a list of token ids (integers from 0 to 2**32 - 1)."}

    def to_internal_value(self, data) -> bytes:
        if not isinstance(data, list) or not all(_is_token_id(value) for value in data):
            self.fail("not_token_ids")
        return struct.pack(f"<{len(data)}I", *data)

    def to_representation(self, value) -> list[int]:
        raw = bytes(value)
        return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


@extend_schema_field({"type": "integer", "minimum": 0, "maximum": MAX_UNIX_SECONDS})
class UnixSecondsField(serializers.Field):
    """A moment as whole seconds since the epoch (a JSON integer)."""

    default_error_messages = {"invalid": "Must be whole seconds since the epoch (a JSON integer from 0 to 2**36)."}

    def to_internal_value(self, data) -> datetime:
        if isinstance(data, bool) or not isinstance(data, int) or not 0 <= data <= MAX_UNIX_SECONDS:
            self.fail("invalid")
        return datetime.fromtimestamp(data, UTC)

    def to_representation(self, value: datetime) -> int:
        return int(value.timestamp())


@extend_schema_field({"type": "object", "additionalProperties": True})
class ObjectField(serializers.JSONField):
    default_error_messages = {"not_object": "Must be a JSON object."}

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("not_object")
        return super().to_internal_value(data)


@extend_schema_field({"type": "array", "items": {}})
class ListField(serializers.JSONField):
    default_error_messages = {"not_list": "Must be a JSON list."}

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("not_list")
        return super().to_internal_value(data)


class StoredResponseSerializer(StrictInputSerializer):
    """A stored response as the gateway sends it and gets it back."""

    id = PatternTextField(RESPONSE_ID_PATTERN, source="public_id")
    organization_id = PatternTextField(PUBLIC_ID_PATTERN, source="organization.public_id")
    api_key_id = PatternTextField(PUBLIC_ID_PATTERN, source="api_key.public_id", default="", allow_blank=True)
    model = PatternTextField(MODEL_PATTERN, help_text="The catalog's name of the model.")
    status = serializers.ChoiceField(choices=ResponseStatus.choices)
    background = serializers.BooleanField()
    request = ObjectField()
    metadata = ObjectField()
    context_items = ListField()
    input_items = ListField()
    output_items = ListField()
    usage = ObjectField(allow_null=True)
    error = ObjectField(allow_null=True)
    incomplete_details = ObjectField(allow_null=True)
    prompt_token_ids = TokenIdsField()
    output_token_ids = TokenIdsField()
    created_at = UnixSecondsField()
    completed_at = UnixSecondsField(allow_null=True)


class ResponseStoreInputSerializer(StoredResponseSerializer):
    create = serializers.BooleanField(
        default=True, help_text="False: update only a response still stored (one deleted meanwhile stays deleted)."
    )


class ResponseStoreOutputSerializer(serializers.Serializer):
    id = serializers.CharField()
    status = serializers.CharField(allow_null=True, help_text="As kept (a cancel stays); null: not stored.")


class OrganizationQuerySerializer(QueryFilterSerializer):
    organization_id = serializers.RegexField(PUBLIC_ID_PATTERN, help_text="The organization that owns the response.")


class OrganizationBodySerializer(StrictInputSerializer):
    organization_id = PatternTextField(PUBLIC_ID_PATTERN, help_text="The organization that owns the response.")


def _owned(organization_id: str, response_id: str) -> StoredResponse:
    return response_get(organization=organization_get(public_id=organization_id), public_id=response_id)


def _organization_query(request: Request, serializer_class=OrganizationQuerySerializer) -> dict:
    query = serializer_class(data=request.query_params)
    query.is_valid(raise_exception=True)
    return query.validated_data


class ResponseStoreApi(InternalAPIView):
    @extend_schema(request=ResponseStoreInputSerializer, responses=ResponseStoreOutputSerializer)
    def post(self, request: Request) -> Response:
        serializer = ResponseStoreInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        public_id, create = data.pop("public_id"), data.pop("create")
        organization = organization_get(public_id=data.pop("organization")["public_id"])
        api_key_id = data.pop("api_key", {}).get("public_id", "")
        row = response_store(
            organization=organization,
            api_key_id=api_key_id,
            public_id=public_id,
            content=ResponseContent(**data),
            create=create,
        )
        status = None if row is None else row.status
        return Response(ResponseStoreOutputSerializer({"id": public_id, "status": status}).data)


class ResponseDetailApi(InternalAPIView):
    class ResponseDeletedOutputSerializer(serializers.Serializer):
        id = serializers.CharField()
        deleted = serializers.BooleanField()

    @extend_schema(parameters=[OrganizationQuerySerializer], responses=StoredResponseSerializer)
    def get(self, request: Request, response_id: str) -> Response:
        row = _owned(_organization_query(request)["organization_id"], response_id)
        return Response(StoredResponseSerializer(row).data)

    @extend_schema(parameters=[OrganizationQuerySerializer], responses=ResponseDeletedOutputSerializer)
    def delete(self, request: Request, response_id: str) -> Response:
        response_delete(response=_owned(_organization_query(request)["organization_id"], response_id))
        return Response(self.ResponseDeletedOutputSerializer({"id": response_id, "deleted": True}).data)


class ResponseStatusApi(InternalAPIView):
    """A background response's runner polls this for a cancel that another gateway received."""

    class ResponseStatusOutputSerializer(serializers.Serializer):
        id = serializers.CharField()
        status = serializers.CharField()

    @extend_schema(parameters=[OrganizationQuerySerializer], responses=ResponseStatusOutputSerializer)
    def get(self, request: Request, response_id: str) -> Response:
        organization = organization_get(public_id=_organization_query(request)["organization_id"])
        status = response_status_get(organization=organization, public_id=response_id)
        return Response(self.ResponseStatusOutputSerializer({"id": response_id, "status": status}).data)


class ResponseCancelApi(InternalAPIView):
    @extend_schema(request=OrganizationBodySerializer, responses=StoredResponseSerializer)
    def post(self, request: Request, response_id: str) -> Response:
        body = OrganizationBodySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        row = response_cancel(response=_owned(body.validated_data["organization_id"], response_id))
        return Response(StoredResponseSerializer(row).data)


class ResponseInputItemsApi(InternalAPIView):
    class InputItemsQuerySerializer(OrganizationQuerySerializer):
        limit = serializers.IntegerField(required=False, min_value=1, max_value=MAX_PAGE, default=20)
        after = serializers.RegexField(ITEM_ID_PATTERN, required=False, help_text="The id of the last item seen.")
        order = serializers.ChoiceField(choices=["asc", "desc"], required=False, default="desc")

    class InputItemsOutputSerializer(serializers.Serializer):
        object = serializers.ChoiceField(choices=["list"])
        data = serializers.ListField(child=serializers.JSONField())
        first_id = serializers.CharField(allow_null=True)
        last_id = serializers.CharField(allow_null=True)
        has_more = serializers.BooleanField()

    @extend_schema(parameters=[InputItemsQuerySerializer], responses=InputItemsOutputSerializer)
    def get(self, request: Request, response_id: str) -> Response:
        query = _organization_query(request, self.InputItemsQuerySerializer)
        row = _owned(query["organization_id"], response_id)
        page = input_item_page(response=row, after=query.get("after"), limit=query["limit"], order=query["order"])
        body = {
            "object": "list",
            "data": page.items,
            "first_id": page.items[0].get("id") if page.items else None,
            "last_id": page.items[-1].get("id") if page.items else None,
            "has_more": page.has_more,
        }
        return Response(self.InputItemsOutputSerializer(body).data)
