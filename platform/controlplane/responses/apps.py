from django.apps import AppConfig


class ResponsesConfig(AppConfig):
    name = "controlplane.responses"
    verbose_name = "Responses"
