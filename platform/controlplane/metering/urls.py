from django.urls import path

from controlplane.metering import apis

urlpatterns = [
    path("usage-events", apis.UsageEventListApi.as_view(), name="usage-event-list"),
    path("usage/summary", apis.UsageSummaryApi.as_view(), name="usage-summary"),
]
