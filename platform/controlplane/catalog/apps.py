from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "controlplane.catalog"
    verbose_name = "Catalog and fleets"
