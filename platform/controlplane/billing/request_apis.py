"""One request of the usage ledger with its phases and what it cost: GET /api/v1/usage/requests/{request_id}.

Served here, not by metering, because the cost is billing's arithmetic (rating.py) over metering's ledger.
"""

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.billing.request_costs import request_cost
from controlplane.catalog.models import PricePhase
from controlplane.catalog.selectors import price_book
from controlplane.common.errors import InvalidInput
from controlplane.metering.apis import RequestTimelineOutputSerializer
from controlplane.metering.models import UsageEvent
from controlplane.metering.selectors import request_timeline_get
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView

MAX_REQUEST_ID_LENGTH = UsageEvent._meta.get_field("request_id").max_length


class RequestCostOutputSerializer(serializers.Serializer):
    class CostLineSerializer(serializers.Serializer):
        phase = serializers.ChoiceField(choices=PricePhase.choices)
        tokens = serializers.IntegerField()
        unit_price_micros_per_million = serializers.IntegerField(
            allow_null=True, help_text="The price in effect when the phase started; null: unpriced, billed nothing."
        )

    currency = serializers.CharField()
    amount_micros = serializers.IntegerField(help_text="Σ tokens × unit price, rounded half up once, for the request.")
    lines = CostLineSerializer(many=True)


class UsageRequestDetailOutputSerializer(RequestTimelineOutputSerializer):
    cost = RequestCostOutputSerializer()


class UsageRequestDetailApi(TenantAPIView):
    """A request's phases in time order, its totals and its cost.

    `request_id` is the X-Request-Id header the gateway answered the request with (`exec_` and 32 hex
    digits; choice i >= 1 of an n > 1 request is `exec_…-c<i>`). A client's own label of the request (`user`
    in the OpenAI API, `metadata.user_id` in Anthropic's) is accepted too when it labels exactly one request:
    one that labels several is refused with `ambiguous_request_id`. A request of another organization is not
    found (404), as if it did not exist."""

    required_permissions = {"GET": Permission.USAGE_READ}

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "request_id",
                {"type": "string", "maxLength": MAX_REQUEST_ID_LENGTH},
                OpenApiParameter.PATH,
                description="exec_…, as the gateway's X-Request-Id header; or a client's label of one request.",
            )
        ],
        responses=UsageRequestDetailOutputSerializer,
    )
    def get(self, request: Request, request_id: str) -> Response:
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidInput(
                f"A request id is at most {MAX_REQUEST_ID_LENGTH} characters.",
                fields={"request_id": [f"At most {MAX_REQUEST_ID_LENGTH} characters."]},
            )
        timeline = request_timeline_get(organization=self.organization, request_id=request_id)
        cost = request_cost(events=timeline.events, book=price_book())
        return Response(
            {**RequestTimelineOutputSerializer(timeline).data, "cost": RequestCostOutputSerializer(cost).data}
        )
