from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "controlplane.billing"
    verbose_name = "Billing"
