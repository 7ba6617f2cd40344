from django.urls import path

from controlplane.catalog import apis

urlpatterns = [
    path("models", apis.ModelListApi.as_view(), name="model-list"),
    path("models/<str:name>", apis.ModelDetailApi.as_view(), name="model-detail"),
    path("prices", apis.PriceListCreateApi.as_view(), name="price-list"),
    path("fleets", apis.FleetListApi.as_view(), name="fleet-list"),
    path("workers", apis.WorkerListApi.as_view(), name="worker-list"),
    path("workers/<str:worker_id>/drain", apis.WorkerDrainApi.as_view(), name="worker-drain"),
]
