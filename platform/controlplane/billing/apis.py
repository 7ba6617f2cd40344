from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.billing.models import InvoiceStatus
from controlplane.billing.selectors import (
    GROUP_BY_FIELDS,
    billing_current,
    invoice_get,
    invoice_list,
    period_costs,
    usage_daily,
    usage_totals,
)
from controlplane.billing.services import spend_limit_set, stripe_event_process
from controlplane.billing.stripe_gateway import InvalidWebhook, StripeNotConfigured, stripe_gateway
from controlplane.catalog.models import PricePhase, PriceTier
from controlplane.common.errors import ApplicationError, InvalidInput
from controlplane.common.filters import DayRangeFilterSerializer, QueryFilterSerializer
from controlplane.common.limits import MAX_BIG_INTEGER
from controlplane.common.pagination import PaginatedListMixin
from controlplane.common.strict_input import StrictInputSerializer, WholeNumberField
from controlplane.tenancy.access import Permission
from controlplane.tenancy.base_apis import TenantAPIView
from controlplane.tenancy.models import ApiKeyKind


class InvoiceLineOutputSerializer(serializers.Serializer):
    model = serializers.CharField()
    phase = serializers.CharField()
    tier = serializers.CharField(help_text="standard, or batch: the Batch API's requests, at its prices.")
    tokens = serializers.IntegerField()
    unit_price_micros_per_million = serializers.IntegerField()
    amount_micros = serializers.IntegerField()


class InvoiceOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id")
    period_start = serializers.DateField()
    period_end = serializers.DateField(help_text="Exclusive: the first day after the period.")
    status = serializers.ChoiceField(choices=InvoiceStatus.choices)
    currency = serializers.CharField()
    total_micros = serializers.IntegerField()
    total_cents = serializers.IntegerField()
    lines = InvoiceLineOutputSerializer(many=True)
    stripe_invoice_id = serializers.CharField(allow_null=True)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["stripe_invoice_id"] = data["stripe_invoice_id"] or None
        return data


class SpendLimitSerializer(StrictInputSerializer):
    limit_micros = WholeNumberField(
        min_value=0, max_value=MAX_BIG_INTEGER, allow_null=True, help_text="Micro-dollars per period; null: no cap."
    )


class UsageDailyApi(TenantAPIView):
    required_permissions = {"GET": Permission.USAGE_READ}

    class UsageDailyFilterSerializer(DayRangeFilterSerializer):
        group_by = serializers.ChoiceField(choices=sorted(GROUP_BY_FIELDS), default="phase")
        api_key_kind = serializers.ChoiceField(
            choices=ApiKeyKind.choices,
            required=False,
            help_text="Only the usage of keys of this kind (standard: people's keys; batch_runner: batches').",
        )
        project_id = serializers.CharField(required=False, max_length=64, help_text="Only this project's usage.")

    class UsageDailyOutputSerializer(serializers.Serializer):
        class UsageDailyRowSerializer(serializers.Serializer):
            day = serializers.DateField()
            key = serializers.CharField()
            tokens = serializers.IntegerField(
                help_text="Tokens of the row; with group_by=phase, cached tokens are the cached_prefill row's, "
                "beside (not inside) the prefill row's, as usage/summary counts them."
            )
            amount_micros = serializers.IntegerField()

        class UsageTotalSerializer(serializers.Serializer):
            key = serializers.CharField()
            tokens = serializers.IntegerField()
            amount_micros = serializers.IntegerField(
                help_text="The key's share of total_micros, in proportion to its exact amount: the keys add up to it."
            )

        object = serializers.ChoiceField(choices=["list"])
        data = UsageDailyRowSerializer(many=True)
        totals = UsageTotalSerializer(many=True, help_text="Per key over the whole range.")
        total_micros = serializers.IntegerField(
            help_text="The range's spend as an invoice of it would charge: for a range holding the open period's "
            "usage, billing/current/costs' total_micros."
        )

    @extend_schema(parameters=[UsageDailyFilterSerializer], responses=UsageDailyOutputSerializer)
    def get(self, request: Request) -> Response:
        filters = self.UsageDailyFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        rows = usage_daily(organization=self.organization, **filters.validated_data)
        totals = usage_totals(organization=self.organization, **filters.validated_data)
        body = {"object": "list", "data": rows, "totals": totals.totals, "total_micros": totals.total_micros}
        return Response(self.UsageDailyOutputSerializer(body).data)


class BillingCurrentApi(TenantAPIView):
    required_permissions = {"GET": Permission.BILLING_READ}

    class BillingCurrentOutputSerializer(serializers.Serializer):
        class AlertSerializer(serializers.Serializer):
            threshold_percent = serializers.IntegerField()
            triggered_at = serializers.DateTimeField()

        period_start = serializers.DateField()
        period_end = serializers.DateField()
        currency = serializers.CharField()
        amount_to_date_micros = serializers.IntegerField()
        projected_micros = serializers.IntegerField()
        spend_limit_micros = serializers.IntegerField(allow_null=True)
        alerts = AlertSerializer(many=True)

    @extend_schema(responses=BillingCurrentOutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(self.BillingCurrentOutputSerializer(billing_current(organization=self.organization)).data)


class BillingCurrentCostsApi(TenantAPIView):
    """What the open period's usage costs so far, per billed phase and per day × model × phase × tier."""

    required_permissions = {"GET": Permission.BILLING_READ}

    class BillingCurrentCostsOutputSerializer(serializers.Serializer):
        class PhaseCostSerializer(serializers.Serializer):
            phase = serializers.ChoiceField(choices=PricePhase.choices)
            tokens = serializers.IntegerField()
            amount_micros = serializers.IntegerField()

        class DailyCostSerializer(serializers.Serializer):
            day = serializers.DateField(help_text="The day the usage happened (UTC).")
            model = serializers.CharField()
            phase = serializers.ChoiceField(choices=PricePhase.choices)
            tier = serializers.ChoiceField(choices=PriceTier.choices, help_text="batch: rated at the batch price.")
            tokens = serializers.IntegerField()
            amount_micros = serializers.IntegerField(help_text="Rounded half up once per row.")

        period_start = serializers.DateField()
        period_end = serializers.DateField(help_text="Exclusive: the first day after the period.")
        currency = serializers.CharField(default="usd")
        as_of = serializers.DateTimeField(allow_null=True, help_text="Usage ingested before this is counted.")
        total_micros = serializers.IntegerField(help_text="The sum of the invoice lines the period would have now.")
        phases = PhaseCostSerializer(many=True, help_text="prefill, cached_prefill and decode, always all three.")
        data = DailyCostSerializer(many=True, source="rows")

    @extend_schema(responses=BillingCurrentCostsOutputSerializer)
    def get(self, request: Request) -> Response:
        costs = period_costs(organization=self.organization)
        return Response(self.BillingCurrentCostsOutputSerializer(costs).data)


class SpendLimitApi(TenantAPIView):
    required_permissions = {"GET": Permission.BILLING_READ, "PUT": Permission.SPEND_LIMIT_WRITE}

    @extend_schema(responses=SpendLimitSerializer)
    def get(self, request: Request) -> Response:
        return Response({"limit_micros": self.organization.spend_limit_micros})

    @extend_schema(request=SpendLimitSerializer, responses=SpendLimitSerializer)
    def put(self, request: Request) -> Response:
        serializer = SpendLimitSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        organization = spend_limit_set(
            organization=self.organization, limit_micros=serializer.validated_data["limit_micros"], actor=self.principal
        )
        return Response({"limit_micros": organization.spend_limit_micros})


class InvoiceListApi(PaginatedListMixin, TenantAPIView):
    required_permissions = {"GET": Permission.BILLING_READ}

    class InvoiceFilterSerializer(QueryFilterSerializer):
        status = serializers.ChoiceField(choices=InvoiceStatus.choices, required=False)

    @extend_schema(parameters=[InvoiceFilterSerializer], responses=InvoiceOutputSerializer(many=True))
    def get(self, request: Request) -> Response:
        filters = self.InvoiceFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return self.paginated_response(
            queryset=invoice_list(organization=self.organization, **filters.validated_data),
            serializer_class=InvoiceOutputSerializer,
            request=request,
        )


class InvoiceDetailApi(TenantAPIView):
    required_permissions = {"GET": Permission.BILLING_READ}

    @extend_schema(responses=InvoiceOutputSerializer)
    def get(self, request: Request, invoice_id: str) -> Response:
        return Response(InvoiceOutputSerializer(invoice_get(organization=self.organization, public_id=invoice_id)).data)


class StripeWebhookApi(APIView):
    """Stripe's deliveries, authenticated by the Stripe-Signature header alone."""

    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes = [AllowAny]

    class StripeWebhookOutputSerializer(serializers.Serializer):
        event_id = serializers.CharField()
        duplicate = serializers.BooleanField()
        invoice_id = serializers.CharField(allow_null=True)

    @extend_schema(request={"application/json": {"type": "object"}}, responses=StripeWebhookOutputSerializer)
    def post(self, request: Request) -> Response:
        try:
            event = stripe_gateway().parse_webhook(
                payload=request.body, signature=request.headers.get("Stripe-Signature")
            )
        except StripeNotConfigured as error:
            raise ApplicationError(
                f"Stripe webhooks are disabled: {error}", error_type="webhook_not_configured"
            ) from None
        except InvalidWebhook as error:
            raise InvalidInput(str(error), error_type=error.error_type) from None
        outcome = stripe_event_process(event=event)
        return Response(self.StripeWebhookOutputSerializer(outcome).data)
