from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "controlplane.metering"
    verbose_name = "Metering"

    def ready(self) -> None:
        from controlplane.metering.latency_sql import register_sqlite_percentile

        register_sqlite_percentile()
