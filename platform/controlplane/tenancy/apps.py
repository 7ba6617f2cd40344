from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "controlplane.tenancy"
    verbose_name = "Tenancy"
