from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "controlplane.idempotency"
    verbose_name = "Idempotency keys"
