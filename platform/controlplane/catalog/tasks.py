from celery import shared_task

from controlplane.catalog.services import workers_mark_silent_dead


@shared_task
def mark_silent_workers_dead() -> int:
    return workers_mark_silent_dead()
