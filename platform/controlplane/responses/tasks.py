from celery import shared_task
from django.utils import timezone

from controlplane.responses.services import responses_purge_expired


@shared_task
def purge_expired_responses() -> int:
    """Deletes every stored response past its expiry (created_at plus the retention)."""
    return responses_purge_expired(now=timezone.now())
