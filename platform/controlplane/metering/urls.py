from django.urls import path

from controlplane.metering import apis

urlpatterns = [
    path("usage-events", apis.UsageEventListApi.as_view(), name="usage-event-list"),
    path("usage/summary", apis.UsageSummaryApi.as_view(), name="usage-summary"),
    path("usage/requests", apis.UsageRequestsApi.as_view(), name="usage-requests"),
    path("usage/request-log", apis.RequestLogApi.as_view(), name="usage-request-log"),
    path("usage/latency", apis.LatencyApi.as_view(), name="usage-latency"),
    path("rate-limit-refusals", apis.RateLimitRefusalsApi.as_view(), name="rate-limit-refusals"),
]
