"""Stripe, for real against localstripe on loopback: customers, invoice items, invoices, payment, webhooks.

localstripe lacks two things the control plane uses at Stripe: the invoice-creation parameters that pick up
pending items and set collection (`pending_invoice_items_behavior`, `collection_method`, ...) and
`finalize_invoice`. Those two calls sit behind StripeGateway; LocalstripeGateway below replaces only them.
"""

import hashlib
import hmac
import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import stripe

from controlplane.billing.models import BillingAccount, Invoice, InvoiceStatus, ProcessedStripeEvent
from controlplane.billing.services import billing_periods_close, invoice_push, invoices_sync_with_stripe
from controlplane.billing.stripe_gateway import StripeGateway
from controlplane.catalog.services import price_set
from controlplane.tenancy.services import member_add
from diptych_server.stack import free_port
from tests.e2e.waiting import wait_for

STRIPE_KEY = "sk_test_diptych"
WEBHOOK_SECRET = "whsec_diptych_tests"
WEBHOOK_URL = "/api/v1/stripe/webhook"
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)
SERVER = """
import sys
from aiohttp import web
import localstripe.server
from localstripe.resources import store
store.dump_to_disk = lambda: None  # a fresh in-memory store per test session, never the shared pickle
store.clear()
web.run_app(localstripe.server.app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


class LocalstripeGateway(StripeGateway):
    def create_customer(self, **fields):
        # localstripe creates invoices only for a subscription: give each customer a $0 one, before any
        # invoice item exists (its first invoice would otherwise take them).
        customer_id = super().create_customer(**fields)
        product = stripe.Product.create(api_key=self.api_key, name="Diptych usage")
        plan = stripe.Plan.create(api_key=self.api_key, product=product.id, amount=0, currency="usd", interval="month")
        stripe.Subscription.create(api_key=self.api_key, customer=customer_id, items=[{"plan": plan.id}])
        return customer_id

    def create_invoice(self, *, customer_id, description, metadata, idempotency_key):
        # localstripe always takes the pending items and knows no collection settings.
        (subscription,) = stripe.Subscription.list(api_key=self.api_key, customer=customer_id).data
        invoice = stripe.Invoice.create(
            api_key=self.api_key,
            idempotency_key=idempotency_key,
            customer=customer_id,
            subscription=subscription.id,
            description=description,
            metadata=dict(metadata),
        )
        return invoice.id

    def finalize_invoice(self, *, invoice_id, idempotency_key):
        # localstripe has no finalize: its invoices stay drafts until paid.
        return self.invoice_status(invoice_id=invoice_id)


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/v1/customers", headers={"Authorization": f"Bearer {STRIPE_KEY}"}, timeout=1)
    except httpx.TransportError:
        return False
    return True


@pytest.fixture(scope="session")
def localstripe_url():
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is not None or _answers(url), seconds=20, interval=0.05)
        if process.poll() is not None or not _answers(url):
            raise RuntimeError(f"localstripe did not start: {process.stderr.read().decode()[-2000:]}")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def gateway(localstripe_url, settings):
    settings.STRIPE_API_KEY = STRIPE_KEY
    settings.STRIPE_API_BASE = localstripe_url
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    previous = stripe.api_base
    yield LocalstripeGateway(api_key=STRIPE_KEY, api_base=localstripe_url, webhook_secret=WEBHOOK_SECRET)
    stripe.api_base = previous


@pytest.fixture
def closed_invoice(org_a, key_a, tiny_model, internal_client, make_usage_event) -> Invoice:
    """Last-month usage of org A, closed into a draft invoice of three lines (total 244 135 µ$ = 24 cents)."""
    for phase, micros in (("prefill", 100_000), ("cached_prefill", 25_000), ("decode", 400_000)):
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    member_add(organization=org_a, email="billing-owner@acme.test", role="owner", password="owner-password-123")
    started = datetime.now(UTC).replace(day=1, hour=0) - timedelta(days=10)
    events = [
        make_usage_event(key_a, "s-1", "prefill", tokens=1_234_567, cached_tokens=234_567),
        make_usage_event(key_a, "s-1", "decode", tokens=345_678, cached_tokens=0),
    ]
    for event in events:
        event.update(started_at=started.isoformat(), finished_at=(started + timedelta(seconds=1)).isoformat())
    assert internal_client.post("/api/v1/internal/usage-events", {"events": events}).status_code == 200
    (invoice,) = billing_periods_close()
    assert (invoice.total_cents, invoice.status) == (24, InvoiceStatus.DRAFT)
    return invoice


def _give_the_customer_a_card(customer_id: str) -> None:
    method = stripe.PaymentMethod.create(
        api_key=STRIPE_KEY,
        type="card",
        card={"number": "4242424242424242", "exp_month": 12, "exp_year": 2040, "cvc": "123"},
    )
    stripe.PaymentMethod.attach(method.id, customer=customer_id, api_key=STRIPE_KEY)
    stripe.Customer.modify(customer_id, api_key=STRIPE_KEY, invoice_settings={"default_payment_method": method.id})


def test_invoice_push_creates_customer_items_and_invoice_once(gateway, closed_invoice, org_a):
    invoice_push(invoice=closed_invoice, gateway=gateway)
    closed_invoice.refresh_from_db()
    customer_id = BillingAccount.objects.get(organization=org_a).stripe_customer_id
    customer = stripe.Customer.retrieve(customer_id, api_key=STRIPE_KEY)
    assert customer.email == "billing-owner@acme.test"
    assert customer.metadata["organization_id"] == org_a.public_id

    remote = stripe.Invoice.retrieve(closed_invoice.stripe_invoice_id, api_key=STRIPE_KEY)
    lines = closed_invoice.lines.all()
    assert remote.customer == customer_id
    assert remote.total == closed_invoice.total_cents == sum(line.amount_cents for line in lines)
    assert remote.currency == "usd"
    assert all(line.stripe_invoice_item_id.startswith("ii_") for line in lines)
    assert closed_invoice.status == "draft"  # localstripe keeps invoices drafts until paid

    # Retrying the push (as the periodic job does for drafts) creates nothing new at Stripe.
    assert invoices_sync_with_stripe(gateway=gateway) == 1
    assert stripe.InvoiceItem.list(customer=customer_id, api_key=STRIPE_KEY).data == []  # none left pending
    remote = stripe.Invoice.retrieve(closed_invoice.stripe_invoice_id, api_key=STRIPE_KEY)
    usage_lines = sorted(line.amount for line in remote.lines.data if line.amount)
    assert usage_lines == sorted(line.amount_cents for line in lines if line.amount_cents) == [10, 14]
    assert any("diptych-tiny decode: 345,678 tokens" in (line.description or "") for line in remote.lines.data)
    assert remote.total == 24
    ours = [i for i in stripe.Invoice.list(customer=customer_id, api_key=STRIPE_KEY).data if i.total]
    assert [i.id for i in ours] == [closed_invoice.stripe_invoice_id]
    assert BillingAccount.objects.count() == 1


def test_paid_invoice_status_is_pulled_back(gateway, closed_invoice):
    invoice_push(invoice=closed_invoice, gateway=gateway)
    closed_invoice.refresh_from_db()
    _give_the_customer_a_card(BillingAccount.objects.get().stripe_customer_id)
    paid = stripe.Invoice.pay(closed_invoice.stripe_invoice_id, api_key=STRIPE_KEY)
    assert paid.status == "paid"
    invoices_sync_with_stripe(gateway=gateway)
    closed_invoice.refresh_from_db()
    assert closed_invoice.status == "paid"


def _signed(payload: bytes, secret: str = WEBHOOK_SECRET, timestamp: int | None = None) -> str:
    timestamp = timestamp or int(time.time())
    signature = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={signature}"


def post_signed(client, payload: bytes):
    return client.post(WEBHOOK_URL, payload, content_type="application/json", HTTP_STRIPE_SIGNATURE=_signed(payload))


def _event(event_id: str, event_type: str, stripe_invoice_id: str) -> bytes:
    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "type": event_type,
            "created": int(time.time()),
            "data": {"object": {"id": stripe_invoice_id, "object": "invoice"}},
        }
    ).encode()


@pytest.fixture
def webhook_ready(settings, closed_invoice):
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    closed_invoice.stripe_invoice_id = "in_test_webhook"
    closed_invoice.status = InvoiceStatus.OPEN
    closed_invoice.save()
    return closed_invoice


def test_webhook_updates_the_invoice_once_per_event(client, webhook_ready):
    payload = _event("evt_1", "invoice.paid", "in_test_webhook")
    first = post_signed(client, payload)
    assert first.status_code == 200
    assert first.json() == {"event_id": "evt_1", "duplicate": False, "invoice_id": webhook_ready.public_id}
    webhook_ready.refresh_from_db()
    assert webhook_ready.status == "paid"

    webhook_ready.status = InvoiceStatus.OPEN  # were the event applied again, it would be paid again
    webhook_ready.save()
    again = post_signed(client, payload)
    assert again.json()["duplicate"] is True
    webhook_ready.refresh_from_db()
    assert webhook_ready.status == "open"
    assert ProcessedStripeEvent.objects.count() == 1


@pytest.mark.parametrize(
    "signature",
    [None, "t=1,v1=deadbeef", "garbage", "wrong-secret", "stale"],
)
def test_webhook_refuses_bad_signatures_and_changes_nothing(client, webhook_ready, signature):
    payload = _event("evt_bad", "invoice.paid", "in_test_webhook")
    headers = {}
    if signature == "wrong-secret":
        headers["HTTP_STRIPE_SIGNATURE"] = _signed(payload, secret="whsec_other")
    elif signature == "stale":
        headers["HTTP_STRIPE_SIGNATURE"] = _signed(payload, timestamp=int(time.time()) - 3600)
    elif signature is not None:
        headers["HTTP_STRIPE_SIGNATURE"] = signature
    response = client.post(WEBHOOK_URL, payload, content_type="application/json", **headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_signature"
    webhook_ready.refresh_from_db()
    assert webhook_ready.status == "open"
    assert not ProcessedStripeEvent.objects.exists()


def test_webhook_without_a_secret_configured_is_refused(client, settings, db):
    settings.STRIPE_WEBHOOK_SECRET = ""
    payload = _event("evt_x", "invoice.paid", "in_x")
    response = post_signed(client, payload)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "webhook_not_configured"


def test_webhook_for_an_invoice_that_is_not_ours_is_acknowledged(client, webhook_ready):
    payload = _event("evt_2", "invoice.voided", "in_someone_else")
    response = post_signed(client, payload)
    assert response.status_code == 200 and response.json()["invoice_id"] is None
    webhook_ready.refresh_from_db()
    assert webhook_ready.status == "open"


@pytest.mark.django_db(transaction=True)
def test_localstripe_delivers_a_signed_payment_webhook(gateway, closed_invoice, live_server):
    """End to end: localstripe signs and posts invoice.payment_succeeded to the running control plane."""
    registered = httpx.post(
        f"{stripe.api_base}/_config/webhooks/diptych",
        data={
            "url": f"{live_server.url}{WEBHOOK_URL}",
            "secret": WEBHOOK_SECRET,
            "events[]": "invoice.payment_succeeded",
        },
    )
    assert registered.status_code == 200, registered.text
    invoice_push(invoice=closed_invoice, gateway=gateway)
    closed_invoice.refresh_from_db()
    _give_the_customer_a_card(BillingAccount.objects.get().stripe_customer_id)
    stripe.Invoice.pay(closed_invoice.stripe_invoice_id, api_key=STRIPE_KEY)
    # localstripe waits 1 s before delivering
    assert wait_for(lambda: Invoice.objects.get(pk=closed_invoice.pk).status == "paid", seconds=10)
    # localstripe also reports the $0 subscription invoice it made for this customer.
    assert ProcessedStripeEvent.objects.filter(event_type="invoice.payment_succeeded").exists()
