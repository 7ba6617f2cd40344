from django.contrib import admin

from controlplane.billing.models import BillingPeriod, Invoice, InvoiceLine, SpendAlert


class InvoiceLineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    readonly_fields = [
        "model",
        "phase",
        "tokens",
        "unit_price_micros_per_million",
        "amount_micros",
        "amount_cents",
        "stripe_invoice_item_id",
    ]


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    """Invoices are made by the period-closing job; staff read them."""

    list_display = ["public_id", "organization", "period_start", "status", "total_cents", "stripe_invoice_id"]
    list_filter = ["status"]
    inlines = [InvoiceLineInline]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(BillingPeriod)
class BillingPeriodAdmin(admin.ModelAdmin):
    list_display = ["organization", "start", "status", "amount_to_date_micros", "closed_at"]
    list_filter = ["status"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(SpendAlert)
class SpendAlertAdmin(admin.ModelAdmin):
    list_display = ["organization", "period_start", "threshold_percent", "spent_micros", "limit_micros", "triggered_at"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False
