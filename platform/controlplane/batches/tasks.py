from celery import shared_task
from django.utils import timezone

from controlplane.batches.runner import run_slice
from controlplane.batches.selectors import batch_ids_without_runner


@shared_task
def run_batch(batch_id: int, holder: str = "") -> None:
    """One slice of a batch; a batch with lines still ready runs on in a new task, under the same lease, so
    that the other jobs of a single worker get their turn in between."""
    outcome = run_slice(batch_id, holder)
    if outcome.go_on:
        run_batch.delay(batch_id, outcome.holder)


@shared_task
def resume_batches() -> int:
    """Starts a runner for each active batch that has none (its runner died, or its lines wait to retry)."""
    batch_ids = batch_ids_without_runner(now=timezone.now())
    for batch_id in batch_ids:
        run_batch.delay(batch_id)
    return len(batch_ids)
