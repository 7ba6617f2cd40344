from django.urls import path

from controlplane.webhooks import apis

urlpatterns = [
    path("webhooks", apis.EndpointListCreateApi.as_view(), name="webhook-list"),
    path("webhooks/<str:webhook_id>", apis.EndpointDetailApi.as_view(), name="webhook-detail"),
    path("webhooks/<str:webhook_id>/rotate-secret", apis.EndpointRotateSecretApi.as_view(), name="webhook-rotate"),
    path("webhooks/<str:webhook_id>/test", apis.EndpointTestApi.as_view(), name="webhook-test"),
    path("webhooks/<str:webhook_id>/deliveries", apis.EndpointDeliveryListApi.as_view(), name="webhook-deliveries"),
]
