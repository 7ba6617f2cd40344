from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "controlplane.metering"
    verbose_name = "Metering"
