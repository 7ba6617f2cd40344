from django.urls import path

from controlplane.metering import apis

urlpatterns = [
    path("usage-events", apis.UsageEventListApi.as_view(), name="usage-event-list"),
    path("usage/summary", apis.UsageSummaryApi.as_view(), name="usage-summary"),
    path("internal/usage-events", apis.UsageEventIngestApi.as_view(), name="internal-usage-event-ingest"),
    path("internal/idempotency-keys/claim", apis.IdempotencyKeyClaimApi.as_view(), name="internal-idempotency-claim"),
    path(
        "internal/idempotency-keys/complete", apis.IdempotencyKeyCompleteApi.as_view(),
        name="internal-idempotency-complete",
    ),
    path(
        "internal/idempotency-keys/release", apis.IdempotencyKeyReleaseApi.as_view(),
        name="internal-idempotency-release",
    ),
]
