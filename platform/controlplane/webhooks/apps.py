from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "controlplane.webhooks"
    verbose_name = "Webhooks"
