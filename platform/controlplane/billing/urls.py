from django.urls import path

from controlplane.billing import apis, request_apis, usage_bucket_apis

urlpatterns = [
    path("usage/requests/<str:request_id>", request_apis.UsageRequestDetailApi.as_view(), name="usage-request"),
    path("usage/daily", apis.UsageDailyApi.as_view(), name="usage-daily"),
    path("billing/current", apis.BillingCurrentApi.as_view(), name="billing-current"),
    path("billing/current/costs", apis.BillingCurrentCostsApi.as_view(), name="billing-current-costs"),
    path("spend-limit", apis.SpendLimitApi.as_view(), name="spend-limit"),
    path("invoices", apis.InvoiceListApi.as_view(), name="invoice-list"),
    path("invoices/<str:invoice_id>", apis.InvoiceDetailApi.as_view(), name="invoice-detail"),
    path("stripe/webhook", apis.StripeWebhookApi.as_view(), name="stripe-webhook"),
    path(
        "organization/usage/completions",
        usage_bucket_apis.OrganizationUsageCompletionsApi.as_view(),
        name="organization-usage-completions",
    ),
    path("organization/costs", usage_bucket_apis.OrganizationCostsApi.as_view(), name="organization-costs"),
]
