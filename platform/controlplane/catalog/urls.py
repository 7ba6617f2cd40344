from django.urls import path

from controlplane.catalog import apis

urlpatterns = [
    path("models", apis.ModelListApi.as_view(), name="model-list"),
    path("models/<str:name>", apis.ModelDetailApi.as_view(), name="model-detail"),
    path("prices", apis.PriceListCreateApi.as_view(), name="price-list"),
    path("fleets", apis.FleetListApi.as_view(), name="fleet-list"),
    path("workers", apis.WorkerListApi.as_view(), name="worker-list"),
    path("workers/<str:worker_id>/drain", apis.WorkerDrainApi.as_view(), name="worker-drain"),
    path("internal/workers/register", apis.WorkerRegisterApi.as_view(), name="internal-worker-register"),
    path(
        "internal/workers/<str:worker_id>/heartbeat",
        apis.WorkerHeartbeatApi.as_view(),
        name="internal-worker-heartbeat",
    ),
    path("internal/registry", apis.RegistryApi.as_view(), name="internal-registry"),
    path("internal/worker-credential", apis.WorkerCredentialApi.as_view(), name="internal-worker-credential"),
]
