from celery import shared_task

from controlplane.idempotency.services import idempotency_records_purge


@shared_task
def purge_idempotency_records() -> int:
    return idempotency_records_purge()
