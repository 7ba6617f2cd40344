"""The dashboard's webhooks view in a real browser (Playwright driving Debian's Chromium) against the live stack:
an owner sees a URL that leads to loopback refused with the control plane's message, adds an endpoint (its secret
shown once), sends a test event whose failed try heads its deliveries, rotates the secret and deletes the
endpoint; and each delivery of an endpoint shows its status, tries and last answer."""

import secrets

import pytest
from playwright.sync_api import Page, expect

from tests.e2e import test_dashboard as dashboard
from tests.platform.webhook_receiver import Receiver

# The dashboard tests' browser, page and dashboard passwords, shared with this module.
browser = dashboard.browser
page = dashboard.page
passwords = dashboard.passwords
sign_in = dashboard.sign_in

pytestmark = [
    pytest.mark.skipif(not dashboard.CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(not dashboard.DIST.exists(), reason="needs the dashboard bundle: make install"),
]


def delete_endpoint(page: Page, card) -> None:
    card.get_by_role("button", name="Delete").click()
    card.get_by_role("button", name="Confirm delete").click()
    expect(page.locator("#app[data-state=ready]")).to_be_attached()
    expect(card).to_have_count(0)


def test_an_owner_adds_tests_rotates_and_deletes_an_endpoint(page, passwords):
    sign_in(page, dashboard.MEMBER_EMAIL, passwords[dashboard.MEMBER_EMAIL])
    section = page.locator("#webhooks")
    form = page.get_by_role("form", name="Add webhook endpoint")
    form.get_by_label("URL").fill("https://127.0.0.1/hooks")
    form.get_by_role("button", name="Add endpoint").click()
    expect(form.get_by_role("alert")).to_contain_text("127.0.0.1 is a loopback address")

    url = f"https://hooks-{secrets.token_hex(3)}.example.invalid/diptych"  # .invalid never resolves
    form.get_by_label("URL").fill(url)
    form.get_by_label("response.completed").check()
    form.get_by_role("button", name="Add endpoint").click()
    secret = section.locator("[data-new-secret]").inner_text()
    assert secret.startswith("whsec_")
    section.get_by_role("button", name="Done").click()
    expect(page.locator("#app[data-state=ready]")).to_be_attached()
    expect(section.locator("[data-new-secret]")).to_have_count(0)  # shown once
    card = section.locator("[data-webhook]", has_text=url)
    expect(card).to_contain_text("batch.completed, batch.failed, batch.expired, batch.cancelled, response.completed")
    expect(card).to_contain_text(f"secret whsec_…{secret[-4:]}")
    expect(card).to_contain_text("No delivery yet.")

    card.get_by_role("button", name="Send test event").click()
    row = card.locator("[data-table=webhook-deliveries] tbody tr")
    expect(row.locator("[data-status]")).to_have_text("failed")
    expect(row).to_contain_text("does not resolve")

    card.get_by_role("button", name="Rotate secret").click()
    rotated = section.locator("[data-new-secret]").inner_text()
    assert rotated.startswith("whsec_") and rotated != secret
    section.get_by_role("button", name="Done").click()
    expect(card).to_contain_text(f"secret whsec_…{rotated[-4:]}")
    delete_endpoint(page, card)


def test_each_delivery_shows_its_status_tries_and_last_answer(page, passwords, live, control_plane_shell):
    """Two events tried once each, by the control plane's own code in its environment, to a receiver on loopback
    that answers 200 then 500 (the operator's setting that allows loopback is set in that shell only)."""
    with Receiver(statuses=[200, 500]) as receiver:
        control_plane_shell(
            "from django.conf import settings\n"
            "settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = ['127.0.0.0/8']\n"
            "settings.DIPTYCH_WEBHOOKS_ALLOW_HTTP = True\n"
            "from controlplane.tenancy.models import Organization\n"
            "from controlplane.webhooks.delivery import try_delivery\n"
            "from controlplane.webhooks.models import WebhookDelivery\n"
            "from controlplane.webhooks.services import emit_event, endpoint_create\n"
            f"organization = Organization.objects.get(public_id={live.credentials.organization_id!r})\n"
            f"endpoint_create(organization=organization, url={receiver.url!r}, name='orders-webhook',"
            " event_types=['batch.completed', 'batch.expired'])\n"
            "for event_type in ('batch.completed', 'batch.expired'):\n"
            f"    data = {{'id': 'batch_{secrets.token_hex(4)}'}}\n"
            "    event = emit_event(organization=organization, event_type=event_type, data=data)\n"
            "    try_delivery(WebhookDelivery.objects.get(event=event).id)\n"
        )
        assert [attempt.status for attempt in receiver.tries] == [200, 500]
    sign_in(page, dashboard.MEMBER_EMAIL, passwords[dashboard.MEMBER_EMAIL])
    card = page.locator("#webhooks [data-webhook]", has_text="orders-webhook")
    rows = card.locator("[data-table=webhook-deliveries] tbody tr")
    expect(rows).to_have_count(2)
    expired, completed = rows.nth(0), rows.nth(1)  # newest first
    expect(completed).to_contain_text("batch.completed")
    expect(completed.locator("[data-status]")).to_have_text("delivered")
    expect(completed).to_contain_text("HTTP 200")
    expect(expired).to_contain_text("batch.expired")
    expect(expired.locator("[data-status]")).to_have_text("pending")  # tried again in 90 s
    expect(expired).to_contain_text("HTTP 500: not now")
    expect(expired.locator("td").nth(3)).to_have_text("1")
    delete_endpoint(page, card)
