"""Mounted at /api/v1/internal/ by the project's urls: every endpoint here is internal, and only here."""

from django.urls import path

from controlplane.internal import apis, responses_apis

urlpatterns = [
    # the gateway's (DIPTYCH_INTERNAL_TOKEN)
    path("api-keys/verify", apis.ApiKeyVerifyApi.as_view(), name="internal-api-key-verify"),
    path("registry", apis.RegistryApi.as_view(), name="internal-registry"),
    path("worker-credential", apis.WorkerCredentialApi.as_view(), name="internal-worker-credential"),
    path("usage-events", apis.UsageEventIngestApi.as_view(), name="internal-usage-event-ingest"),
    path("rate-limit-refusals", apis.RateLimitRefusalIngestApi.as_view(), name="internal-rate-limit-refusal-ingest"),
    path("idempotency-keys/claim", apis.IdempotencyKeyClaimApi.as_view(), name="internal-idempotency-claim"),
    path("idempotency-keys/complete", apis.IdempotencyKeyCompleteApi.as_view(), name="internal-idempotency-complete"),
    path("idempotency-keys/release", apis.IdempotencyKeyReleaseApi.as_view(), name="internal-idempotency-release"),
    path("webhooks/events", apis.WebhookEventEmitApi.as_view(), name="internal-webhook-event-emit"),
    path("responses", responses_apis.ResponseStoreApi.as_view(), name="internal-response-store"),
    path("responses/<str:response_id>", responses_apis.ResponseDetailApi.as_view(), name="internal-response-detail"),
    path(
        "responses/<str:response_id>/status",
        responses_apis.ResponseStatusApi.as_view(),
        name="internal-response-status",
    ),
    path(
        "responses/<str:response_id>/cancel",
        responses_apis.ResponseCancelApi.as_view(),
        name="internal-response-cancel",
    ),
    path(
        "responses/<str:response_id>/input-items",
        responses_apis.ResponseInputItemsApi.as_view(),
        name="internal-response-input-items",
    ),
    path(
        "artifacts/models/<str:model>/manifest",
        apis.ModelArtifactManifestApi.as_view(),
        name="internal-model-artifact-manifest",
    ),
    path(
        "artifacts/models/<str:model>/files/<str:revision>/<path:path>",
        apis.ModelArtifactFileApi.as_view(),
        name="internal-model-artifact-file",
    ),
    # the command line's (DIPTYCH_INTERNAL_TOKEN)
    path("models/register", apis.ModelRegisterApi.as_view(), name="internal-model-register"),
    # the workers' (their fleet's token)
    path("workers/register", apis.WorkerRegisterApi.as_view(), name="internal-worker-register"),
    path("workers/<str:worker_id>/heartbeat", apis.WorkerHeartbeatApi.as_view(), name="internal-worker-heartbeat"),
    path("artifacts/manifest", apis.ArtifactManifestApi.as_view(), name="internal-artifact-manifest"),
    path(
        "artifacts/files/<str:model>/<str:revision>/<path:path>",
        apis.ArtifactFileApi.as_view(),
        name="internal-artifact-file",
    ),
]
