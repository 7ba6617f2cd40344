"""The dashboard's rate-limits view in a real browser (Playwright driving Debian's Chromium) against the live
stack: an owner sets a key's limits, the gateway enforces them and says so in its headers, and its refusals
show on the dashboard by key and limit; a refused value
shows the control plane's message and changes nothing; a developer sees the limits without the form."""

import datetime
import secrets

import httpx
import pytest
from playwright.sync_api import expect

from tests.e2e import test_dashboard as dashboard
from tests.e2e.waiting import wait_for

# The dashboard tests' browser, page and dashboard passwords, shared with this module.
browser = dashboard.browser
page = dashboard.page
passwords = dashboard.passwords
sign_in = dashboard.sign_in
MEMBER_EMAIL = dashboard.MEMBER_EMAIL

MODEL = "diptych-tiny"
DEVELOPER_EMAIL = "limits-developer@diptych.local"

pytestmark = [
    pytest.mark.skipif(not dashboard.CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(not dashboard.DIST.exists(), reason="needs the dashboard bundle: make install"),
]


def new_key(live, name: str) -> dict:
    with live.rest() as rest:
        response = rest.post("/api-keys", json={"name": name, "scopes": ["inference"]})
    assert response.status_code == 201, response.text
    return response.json()


def key_limits(live, key_id: str) -> dict:
    with live.rest() as rest:
        return rest.get(f"/api-keys/{key_id}/limits").json()


def complete(live, secret: str) -> httpx.Response:
    return httpx.post(
        f"{live.http_urls['split']}/completions",
        headers={"Authorization": f"Bearer {secret}"},
        json={"model": MODEL, "prompt": "limits", "max_tokens": 4},
        timeout=30,
    )


def today() -> dict:
    day = datetime.datetime.now(datetime.UTC).date().isoformat()
    return {"start": day, "end": day}


def test_an_owner_sets_a_keys_limits_which_the_gateway_enforces(page, live, passwords):
    key = new_key(live, f"limits-ui-{secrets.token_hex(3)}")
    sign_in(page, MEMBER_EMAIL, passwords[MEMBER_EMAIL])
    limits = page.locator("#limits")
    expect(limits.locator("[data-table=limits] tr", has_text="Organization")).to_be_visible()
    row = limits.locator("[data-table=limits] tr", has_text=key["name"])
    expect(row).to_contain_text("unlimited")

    form = page.get_by_role("form", name="Rate limits")
    form.get_by_label("Limits of").select_option(label=f"Key {key['name']} ({key['prefix']}…)")
    form.get_by_label("Requests / min").fill("3")
    form.get_by_label("Output tokens / min").fill("40")
    form.get_by_role("button", name="Set limits").click()
    expect(page.locator("#app[data-state=ready]")).to_be_attached()
    row = page.locator("#limits [data-table=limits] tr", has_text=key["name"])
    expect(row).to_contain_text("3")
    expect(row).to_contain_text("40")
    assert key_limits(live, key["id"])["requests_per_minute"] == 3

    response = complete(live, key["key"])
    assert response.status_code == 200, response.text
    assert response.headers["x-ratelimit-limit-requests"] == "3"
    assert response.headers["x-ratelimit-remaining-requests"] == "2"
    assert response.headers["x-ratelimit-limit-tokens"] == "40"
    assert response.headers["x-ratelimit-remaining-tokens"] == "36"  # 4 reserved for this request

    # Over the key's 3 requests a minute: refused (429), and the refusals show on the dashboard by key and limit.
    statuses = [complete(live, key["key"]).status_code for _ in range(4)]
    assert statuses.count(429) >= 2, statuses  # 2 of the minute's 3 requests were left

    def reported() -> int:
        with live.rest() as rest:
            rows = rest.get("/rate-limit-refusals", params=today()).json()["data"]
        return sum(row["refusals"] for row in rows if row["api_key_id"] == key["id"])

    assert wait_for(lambda: reported() == statuses.count(429), seconds=15)
    page.reload()
    refused = page.locator("#refusals [data-table=refusals] tr", has_text=key["name"])
    expect(refused).to_contain_text("Key requests / min: 3")
    expect(refused.locator("td").nth(3)).to_have_text(str(statuses.count(429)))

    form = page.get_by_role("form", name="Rate limits")
    form.get_by_label("Limits of").select_option(label=f"Key {key['name']} ({key['prefix']}…)")
    expect(form.get_by_label("Requests / min")).to_have_value("3")
    form.get_by_label("Requests / min").fill("-1")
    form.get_by_role("button", name="Set limits").click()
    expect(form.get_by_role("alert")).to_contain_text("requests_per_minute")
    assert key_limits(live, key["id"])["requests_per_minute"] == 3


def test_a_developer_sees_the_limits_without_the_form(page, live, control_plane_shell):
    password = secrets.token_urlsafe(12)
    control_plane_shell(
        "from controlplane.tenancy.models import Organization, Membership\n"
        "from controlplane.tenancy.services import member_add, user_ensure\n"
        f"user = user_ensure(email={DEVELOPER_EMAIL!r}, password={password!r})\n"
        "if not Membership.objects.filter(user=user).exists():\n"
        f"    member_add(organization=Organization.objects.get(public_id={live.credentials.organization_id!r}),"
        f" email={DEVELOPER_EMAIL!r}, role='developer')\n"
    )
    sign_in(page, DEVELOPER_EMAIL, password)
    expect(page.locator("#limits [data-table=limits] tr", has_text="Organization")).to_be_visible()
    expect(page.get_by_role("form", name="Rate limits")).to_have_count(0)
