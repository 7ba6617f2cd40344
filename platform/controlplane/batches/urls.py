from django.urls import path

from controlplane.batches import apis

urlpatterns = [
    path("files", apis.FileListCreateApi.as_view(), name="file-list"),
    path("files/<str:file_id>", apis.FileDetailApi.as_view(), name="file-detail"),
    path("files/<str:file_id>/content", apis.FileContentApi.as_view(), name="file-content"),
    path("batches", apis.BatchListCreateApi.as_view(), name="batch-list"),
    path("batches/<str:batch_id>", apis.BatchDetailApi.as_view(), name="batch-detail"),
    path("batches/<str:batch_id>/cancel", apis.BatchCancelApi.as_view(), name="batch-cancel"),
]
