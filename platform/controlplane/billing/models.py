from django.db import models

from controlplane.catalog.models import PricePhase, PriceTier
from controlplane.common.ids import PUBLIC_ID_MAX_LENGTH, new_public_id
from controlplane.tenancy.models import ApiKey, Organization


def new_invoice_id() -> str:
    return new_public_id("inv")


class PeriodStatus(models.TextChoices):
    OPEN = "open"
    CLOSED = "closed"


class BillingPeriod(models.Model):
    """A calendar month (UTC) of one organization; usage events are assigned to one when ingested."""

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="billing_periods")
    start = models.DateField()
    end = models.DateField(help_text="Exclusive: the first day of the next period.")
    status = models.CharField(max_length=8, choices=PeriodStatus.choices, default=PeriodStatus.OPEN)
    amount_to_date_micros = models.PositiveBigIntegerField(default=0, help_text="As of the last rollup.")
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["organization", "start"], name="billing_one_period_per_start")]

    def __str__(self) -> str:
        return f"{self.organization.name} {self.start:%Y-%m} ({self.status})"


class UsageRollup(models.Model):
    """Tokens of one API key, model, billed phase and price tier at one unit price, per bucket; rebuilt from
    the ledger."""

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="+")
    model = models.CharField(max_length=200)
    phase = models.CharField(max_length=16, choices=PricePhase.choices)
    tier = models.CharField(max_length=16, choices=PriceTier.choices, default=PriceTier.STANDARD)
    period_start = models.DateField()
    unit_price_micros_per_million = models.PositiveBigIntegerField(null=True, help_text="Null: no price in effect.")
    tokens = models.PositiveBigIntegerField()

    class Meta:
        abstract = True


class HourlyUsage(UsageRollup):
    hour = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["hour"]), models.Index(fields=["organization", "period_start"])]


class DailyUsage(UsageRollup):
    day = models.DateField()

    class Meta:
        indexes = [models.Index(fields=["organization", "day"]), models.Index(fields=["organization", "period_start"])]


ROLLUP_CURSOR = "usage"  # the name of the usage rollup's RollupCursor row


class RollupCursor(models.Model):
    """How far the rollup job has read the ledger, by ingestion time."""

    name = models.CharField(max_length=32, primary_key=True)
    ingested_before = models.DateTimeField()


class InvoiceStatus(models.TextChoices):
    DRAFT = "draft"
    OPEN = "open"
    PAID = "paid"
    VOID = "void"
    UNCOLLECTIBLE = "uncollectible"


class Invoice(models.Model):
    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_invoice_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="invoices")
    period_start = models.DateField()
    period_end = models.DateField()
    status = models.CharField(max_length=16, choices=InvoiceStatus.choices, default=InvoiceStatus.DRAFT)
    currency = models.CharField(max_length=3, default="usd")
    total_micros = models.PositiveBigIntegerField()
    total_cents = models.PositiveBigIntegerField()
    stripe_invoice_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "period_start"], name="billing_one_invoice_per_period")
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.organization.name} {self.period_start:%Y-%m} {self.status}"


class InvoiceLine(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    model = models.CharField(max_length=200)
    phase = models.CharField(max_length=16, choices=PricePhase.choices)
    tier = models.CharField(max_length=16, choices=PriceTier.choices, default=PriceTier.STANDARD)
    tokens = models.PositiveBigIntegerField()
    unit_price_micros_per_million = models.PositiveBigIntegerField()
    amount_micros = models.PositiveBigIntegerField()
    amount_cents = models.PositiveBigIntegerField(help_text="This line's share of the invoice total in cents.")
    stripe_invoice_item_id = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        ordering = ["model", "phase", "tier", "unit_price_micros_per_million"]


class SpendAlert(models.Model):
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="spend_alerts")
    period_start = models.DateField()
    threshold_percent = models.PositiveSmallIntegerField()
    spent_micros = models.PositiveBigIntegerField()
    limit_micros = models.PositiveBigIntegerField()
    triggered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "period_start", "threshold_percent"], name="billing_one_alert_per_threshold"
            )
        ]


class BillingAccount(models.Model):
    organization = models.OneToOneField(Organization, on_delete=models.CASCADE, related_name="billing_account")
    stripe_customer_id = models.CharField(max_length=64, unique=True)


class ProcessedStripeEvent(models.Model):
    """Stripe delivers webhooks at least once: an event id seen here is acknowledged and ignored."""

    event_id = models.CharField(max_length=255, unique=True)
    event_type = models.CharField(max_length=100)
    received_at = models.DateTimeField(auto_now_add=True)
