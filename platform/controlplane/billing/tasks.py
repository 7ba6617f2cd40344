import logging

from celery import shared_task

from controlplane.billing.services import billing_periods_close, invoices_sync_with_stripe, usage_rollup
from controlplane.billing.stripe_gateway import stripe_gateway

logger = logging.getLogger(__name__)


@shared_task
def roll_up_usage() -> int:
    return usage_rollup().hours


@shared_task
def close_billing_periods() -> int:
    return len(billing_periods_close())


@shared_task
def sync_invoices_with_stripe() -> int:
    gateway = stripe_gateway()
    if not gateway.configured:
        logger.info("STRIPE_API_KEY is not set: invoices stay drafts.")
        return 0
    return invoices_sync_with_stripe(gateway=gateway)
