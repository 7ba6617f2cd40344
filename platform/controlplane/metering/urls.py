from django.urls import path

from controlplane.metering import apis

urlpatterns = [
    path("usage-events", apis.UsageEventListApi.as_view(), name="usage-event-list"),
    path("usage/summary", apis.UsageSummaryApi.as_view(), name="usage-summary"),
    path("usage/requests", apis.UsageRequestsApi.as_view(), name="usage-requests"),
    path("rate-limit-refusals", apis.RateLimitRefusalsApi.as_view(), name="rate-limit-refusals"),
]
