from django.urls import path

from controlplane.responses import apis

urlpatterns = [
    path("responses/storage", apis.ResponseStorageApi.as_view(), name="response-storage"),
]
