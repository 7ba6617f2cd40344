from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "controlplane.batches"
    verbose_name = "Batches"
