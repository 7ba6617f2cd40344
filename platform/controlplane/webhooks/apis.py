"""The webhook endpoints of an organization at `/webhooks`, in the shapes of OpenAI's webhook endpoint objects
(`object: "webhook_endpoint"`, the secret answered only on create and rotation), and each endpoint's
deliveries with every try."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.common.pagination import CursorQuerySerializer, cursor_list_response
from controlplane.common.strict_input import StrictInputSerializer, TextField
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView
from controlplane.webhooks.models import URL_MAX_LENGTH, EventType, WebhookDelivery, WebhookEndpoint
from controlplane.webhooks.selectors import delivery_list, endpoint_get, endpoint_list
from controlplane.webhooks.services import (
    endpoint_create,
    endpoint_delete,
    endpoint_rotate_secret,
    endpoint_send_test,
)
from controlplane.webhooks.signing import secret_hint, unix

EVENT_TYPE_CHOICE_MESSAGE = f"Unknown event type {{input!r}}; use one of {', '.join(EventType.values)}."


def event_type_field(**kwargs) -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=EventType.choices, error_messages={"invalid_choice": EVENT_TYPE_CHOICE_MESSAGE}, **kwargs
    )


class WebhookEndpointOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    object = serializers.SerializerMethodField()
    name = serializers.CharField()
    url = serializers.CharField()
    event_types = serializers.ListField(child=serializers.CharField())
    signing_secret_hint = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    updated_at = serializers.SerializerMethodField()

    def get_object(self, endpoint: WebhookEndpoint) -> str:
        return "webhook_endpoint"

    def get_signing_secret_hint(self, endpoint: WebhookEndpoint) -> str:
        return secret_hint(endpoint.secret)

    def get_created_at(self, endpoint: WebhookEndpoint) -> int:
        return unix(endpoint.created_at)

    def get_updated_at(self, endpoint: WebhookEndpoint) -> int:
        return unix(endpoint.updated_at)


class WebhookEndpointWithSecretOutputSerializer(WebhookEndpointOutputSerializer):
    signing_secret = serializers.CharField(
        source="secret",
        allow_null=True,
        help_text="whsec_<base64>: verify each delivery with it. Answered only here: an idempotent replay of the "
        "request answers null (header `Idempotent-Withheld: signing_secret`).",
    )


class CursorListSerializer(serializers.Serializer):
    object = serializers.CharField()
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class WebhookEndpointListOutputSerializer(CursorListSerializer):
    data = WebhookEndpointOutputSerializer(many=True)


class WebhookAttemptOutputSerializer(serializers.Serializer):
    number = serializers.IntegerField(help_text="1 for the first try.")
    started_at = serializers.DateTimeField()
    duration_ms = serializers.IntegerField()
    status_code = serializers.IntegerField(allow_null=True, help_text="Null: no HTTP answer (see error).")
    error = serializers.CharField(help_text="Empty when the endpoint answered 2xx.")


class WebhookDeliveryOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    object = serializers.SerializerMethodField()
    event_id = serializers.CharField(source="event.public_id", help_text="Also the `webhook-id` of every try.")
    event_type = serializers.CharField(source="event.type")
    data = serializers.JSONField(source="event.data")
    status = serializers.ChoiceField(choices=["pending", "delivered", "failed"])
    created_at = serializers.DateTimeField()
    delivered_at = serializers.DateTimeField(allow_null=True)
    next_attempt_at = serializers.DateTimeField(allow_null=True, help_text="When a pending delivery is tried next.")
    attempts = WebhookAttemptOutputSerializer(source="attempt_log", many=True)

    def get_object(self, delivery: WebhookDelivery) -> str:
        return "webhook_delivery"


class WebhookDeliveryListOutputSerializer(CursorListSerializer):
    data = WebhookDeliveryOutputSerializer(many=True)


class WebhookEndpointDeletedOutputSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    deleted = serializers.BooleanField()


class WebhookEndpointTestResultOutputSerializer(serializers.Serializer):
    object = serializers.SerializerMethodField()
    webhook_endpoint_id = serializers.CharField(source="endpoint.public_id")
    event_type = serializers.CharField()
    success = serializers.SerializerMethodField(help_text="Whether the endpoint answered 2xx.")
    status_code = serializers.SerializerMethodField(help_text="Null: no HTTP answer (see error).")
    error = serializers.SerializerMethodField()
    delivery = WebhookDeliveryOutputSerializer()

    def get_object(self, result) -> str:
        return "webhook_endpoint.test"

    def get_success(self, result) -> bool:
        return result.delivery.status == "delivered"

    def _attempt(self, result):
        return result.delivery.attempt_log.order_by("-number").first()

    def get_status_code(self, result) -> int | None:
        attempt = self._attempt(result)
        return None if attempt is None else attempt.status_code

    def get_error(self, result) -> str:
        attempt = self._attempt(result)
        return "" if attempt is None else attempt.error


class WebhookApiView(TenantAPIView):
    # No request of these endpoints is larger: a URL, a name and a few event types.
    max_body_bytes = 16 * 1024
    idempotency_withheld_fields = ("signing_secret",)


class EndpointListCreateApi(WebhookApiView):
    """The organization's webhook endpoints, newest first; POST adds one and answers its signing secret, once.
    The URL must be https and its host's addresses public (docs/webhooks.md)."""

    required_permissions = {"GET": Permission.WEBHOOKS_READ, "POST": Permission.WEBHOOKS_WRITE}

    class WebhookEndpointCreateInputSerializer(StrictInputSerializer):
        url = TextField(max_length=URL_MAX_LENGTH, help_text="https://...: where deliveries are posted.")
        event_types = serializers.ListField(
            child=event_type_field(), allow_empty=False, max_length=len(EventType.values)
        )
        name = TextField(max_length=100, required=False, default="", allow_blank=True)

    @extend_schema(
        operation_id="webhooks_list", parameters=[CursorQuerySerializer], responses=WebhookEndpointListOutputSerializer
    )
    def get(self, request: Request) -> Response:
        return cursor_list_response(
            endpoint_list(organization=self.organization), WebhookEndpointOutputSerializer, request
        )

    @extend_schema(
        request=WebhookEndpointCreateInputSerializer, responses={201: WebhookEndpointWithSecretOutputSerializer}
    )
    def post(self, request: Request) -> Response:
        serializer = self.WebhookEndpointCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        endpoint = endpoint_create(organization=self.organization, actor=self.principal, **serializer.validated_data)
        return Response(WebhookEndpointWithSecretOutputSerializer(endpoint).data, status=status.HTTP_201_CREATED)


class EndpointDetailApi(WebhookApiView):
    """One webhook endpoint; DELETE removes it with its deliveries, and no try is made after."""

    required_permissions = {"GET": Permission.WEBHOOKS_READ, "DELETE": Permission.WEBHOOKS_WRITE}

    @extend_schema(responses=WebhookEndpointOutputSerializer)
    def get(self, request: Request, webhook_id: str) -> Response:
        endpoint = endpoint_get(organization=self.organization, public_id=webhook_id)
        return Response(WebhookEndpointOutputSerializer(endpoint).data)

    @extend_schema(responses={200: WebhookEndpointDeletedOutputSerializer})
    def delete(self, request: Request, webhook_id: str) -> Response:
        endpoint = endpoint_get(organization=self.organization, public_id=webhook_id)
        endpoint_delete(endpoint=endpoint, actor=self.principal)
        return Response({"id": webhook_id, "object": "webhook_endpoint.deleted", "deleted": True})


class EndpointRotateSecretApi(WebhookApiView):
    """A new signing secret, answered once; the one it replaces signs beside it for 24 hours unless
    `keep_old_secret_active_for_24_hours` is false."""

    required_permissions = {"POST": Permission.WEBHOOKS_WRITE}

    class WebhookRotateSecretInputSerializer(StrictInputSerializer):
        keep_old_secret_active_for_24_hours = serializers.BooleanField(
            required=False,
            default=True,
            help_text="The secret it replaces keeps signing beside the new one for 24 hours (each delivery then "
            "carries both signatures); false stops it at once.",
        )

    @extend_schema(request=WebhookRotateSecretInputSerializer, responses=WebhookEndpointWithSecretOutputSerializer)
    def post(self, request: Request, webhook_id: str) -> Response:
        serializer = self.WebhookRotateSecretInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        endpoint = endpoint_rotate_secret(
            endpoint=endpoint_get(organization=self.organization, public_id=webhook_id),
            keep_old_secret=serializer.validated_data["keep_old_secret_active_for_24_hours"],
            actor=self.principal,
        )
        return Response(WebhookEndpointWithSecretOutputSerializer(endpoint).data)


class EndpointTestApi(WebhookApiView):
    """Sends a sample event (about no real object) to the endpoint once, now, and answers how it went; the try
    is listed among the endpoint's deliveries."""

    required_permissions = {"POST": Permission.WEBHOOKS_WRITE}

    class WebhookTestInputSerializer(StrictInputSerializer):
        event_type = event_type_field(required=False, default=EventType.BATCH_COMPLETED)

    @extend_schema(request=WebhookTestInputSerializer, responses=WebhookEndpointTestResultOutputSerializer)
    def post(self, request: Request, webhook_id: str) -> Response:
        serializer = self.WebhookTestInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = endpoint_send_test(
            endpoint=endpoint_get(organization=self.organization, public_id=webhook_id),
            event_type=serializer.validated_data["event_type"],
        )
        return Response(WebhookEndpointTestResultOutputSerializer(result).data)


class EndpointDeliveryListApi(WebhookApiView):
    """The endpoint's deliveries, newest first, each with every try: when, how long, the HTTP status or the
    error."""

    required_permissions = {"GET": Permission.WEBHOOKS_READ}

    @extend_schema(parameters=[CursorQuerySerializer], responses=WebhookDeliveryListOutputSerializer)
    def get(self, request: Request, webhook_id: str) -> Response:
        endpoint = endpoint_get(organization=self.organization, public_id=webhook_id)
        return cursor_list_response(delivery_list(endpoint=endpoint), WebhookDeliveryOutputSerializer, request)
