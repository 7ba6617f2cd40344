from django.apps import AppConfig


class InternalConfig(AppConfig):
    name = "controlplane.internal"
    label = "internal"
    verbose_name = "Internal endpoints (the gateway's and the workers')"
