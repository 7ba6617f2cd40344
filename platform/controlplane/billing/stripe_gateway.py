"""Every call the control plane makes to Stripe, behind one narrow class; nothing else imports `stripe`.

Idempotency keys are derived from our own ids, so a push that failed half way and is retried creates
nothing twice at Stripe; we also store each Stripe id as soon as we have it and skip what is done, which
keeps retries safe against servers that ignore Idempotency-Key.
"""

from collections.abc import Mapping

import stripe
from django.conf import settings
from stripe.params import CustomerCreateParams

# Stripe statuses that leave an invoice of ours open, paid, void or uncollectible.
STRIPE_INVOICE_STATUSES = {"draft", "open", "paid", "void", "uncollectible"}


class StripeNotConfigured(Exception):
    pass


class InvalidWebhook(Exception):
    def __init__(self, message: str, *, error_type: str):
        super().__init__(message)
        self.error_type = error_type


class StripeGateway:
    def __init__(self, *, api_key: str, api_base: str | None = None, webhook_secret: str = ""):
        self._api_key = api_key
        self.webhook_secret = webhook_secret
        if api_base:
            # The library reads the base URL from the module; one control plane talks to one Stripe.
            stripe.api_base = api_base

    @property
    def configured(self) -> bool:
        return bool(self._api_key)

    @property
    def api_key(self) -> str:
        if not self._api_key:
            raise StripeNotConfigured("STRIPE_API_KEY is not set.")
        return self._api_key

    def create_customer(
        self, *, name: str, email: str | None, metadata: Mapping[str, str], idempotency_key: str
    ) -> str:
        params: CustomerCreateParams = {
            "api_key": self.api_key,
            "idempotency_key": idempotency_key,
            "name": name,
            "metadata": dict(metadata),
        }
        if email:
            params["email"] = email
        customer = stripe.Customer.create(**params)
        return customer.id

    def create_invoice_item(
        self,
        *,
        customer_id: str,
        amount_cents: int,
        currency: str,
        description: str,
        metadata: Mapping[str, str],
        idempotency_key: str,
    ) -> str:
        item = stripe.InvoiceItem.create(
            api_key=self.api_key,
            idempotency_key=idempotency_key,
            customer=customer_id,
            amount=amount_cents,
            currency=currency,
            description=description,
            metadata=dict(metadata),
        )
        return item.id

    def create_invoice(
        self, *, customer_id: str, description: str, metadata: Mapping[str, str], idempotency_key: str
    ) -> str:
        """A draft invoice that takes the customer's pending invoice items."""
        invoice = stripe.Invoice.create(
            api_key=self.api_key,
            idempotency_key=idempotency_key,
            customer=customer_id,
            description=description,
            metadata=dict(metadata),
            pending_invoice_items_behavior="include",
            collection_method="send_invoice",
            days_until_due=settings.STRIPE_DAYS_UNTIL_DUE,
            auto_advance=False,
        )
        return invoice.id

    def finalize_invoice(self, *, invoice_id: str, idempotency_key: str) -> str | None:
        """Finalize the draft so the customer can pay it; returns the invoice's status (Stripe may omit it)."""
        invoice = stripe.Invoice.finalize_invoice(invoice_id, api_key=self.api_key, idempotency_key=idempotency_key)
        return invoice.status

    def invoice_status(self, *, invoice_id: str) -> str | None:
        return stripe.Invoice.retrieve(invoice_id, api_key=self.api_key).status

    def parse_webhook(self, *, payload: bytes, signature: str | None) -> stripe.Event:
        """The event, once its signature checks out (within Stripe's 5-minute tolerance); InvalidWebhook otherwise."""
        if not self.webhook_secret:
            raise StripeNotConfigured("STRIPE_WEBHOOK_SECRET is not set.")
        try:
            return stripe.Webhook.construct_event(payload, signature, self.webhook_secret)
        except stripe.SignatureVerificationError:
            raise InvalidWebhook(
                "Stripe-Signature header missing, stale or not valid for this payload.", error_type="invalid_signature"
            ) from None
        except ValueError:
            raise InvalidWebhook("The payload is not a Stripe event.", error_type="invalid_payload") from None


def stripe_gateway() -> StripeGateway:
    return StripeGateway(
        api_key=settings.STRIPE_API_KEY,
        api_base=settings.STRIPE_API_BASE or None,
        webhook_secret=settings.STRIPE_WEBHOOK_SECRET,
    )
