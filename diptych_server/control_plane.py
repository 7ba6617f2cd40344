"""Runs the control plane's processes: the WSGI application under gunicorn, and the Celery jobs."""

import os

from gunicorn.app.base import BaseApplication


class _ControlPlaneApplication(BaseApplication):
    def __init__(self, options: dict) -> None:
        self._options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            self.cfg.set(key, value)

    def load(self):
        from controlplane.wsgi import application

        return application


def run_control_plane(host: str, port: int, processes: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    _ControlPlaneApplication(
        {
            "bind": f"{host}:{port}",
            "workers": processes,
            "worker_class": "gthread",
            "threads": 8,
            "accesslog": None,
            "graceful_timeout": 10,
        }
    ).run()


def run_jobs() -> None:
    """One Celery worker with the beat scheduler embedded: enough for a single machine."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.conf import settings

    from controlplane.celery import app

    schedule = settings.STATE_DIR / "celerybeat-schedule"
    app.worker_main(["worker", "--beat", "--pool", "solo", "--loglevel", "INFO", "--schedule", str(schedule)])
