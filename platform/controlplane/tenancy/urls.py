from django.urls import path

from controlplane.tenancy import apis

urlpatterns = [
    path("organization", apis.OrganizationDetailApi.as_view(), name="organization-detail"),
    path("api-keys", apis.ApiKeyListCreateApi.as_view(), name="api-key-list"),
    path("api-keys/<str:key_id>", apis.ApiKeyDetailApi.as_view(), name="api-key-detail"),
    path("api-keys/<str:key_id>/revoke", apis.ApiKeyRevokeApi.as_view(), name="api-key-revoke"),
    path("internal/api-keys/verify", apis.ApiKeyVerifyApi.as_view(), name="internal-api-key-verify"),
]
