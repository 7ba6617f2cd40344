"""The Diptych control plane: tenants, API keys, model catalog, worker fleets and metering."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
