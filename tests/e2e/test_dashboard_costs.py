"""The dashboard's cost of the open period, its empty states and errors, and every view at a phone's width, in a
real browser (Playwright driving Debian's Chromium) against the live stack.

Each test here signs in to an organization of its own, whose usage the test ingested the way the gateway reports
it, so the page must show exactly these figures. With DIPTYCH_DASHBOARD_SCREENSHOTS=1 the phone and desktop
screenshots are written to docs/, otherwise to tests/artifacts/:

    DIPTYCH_DASHBOARD_SCREENSHOTS=1 .venv/bin/pytest tests/e2e/test_dashboard_costs.py -k phone
"""

import datetime
import json
import os
import secrets
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.e2e import test_dashboard as dashboard

# The dashboard tests' browser and sign-in, shared with this module.
browser = dashboard.browser
passwords = dashboard.passwords
sign_in = dashboard.sign_in
chart = dashboard.chart

DOCS = Path(__file__).resolve().parents[2] / "docs"
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
MODEL = "diptych-tiny"
PRICES = {"prefill": 100_000, "cached_prefill": 25_000, "decode": 400_000}  # bootstrap's, µ$ per million tokens
BATCH_DECODE_PRICE = PRICES["decode"] // 2

pytestmark = [
    pytest.mark.skipif(not dashboard.CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(not dashboard.DIST.exists(), reason="needs the dashboard bundle: make install"),
]


def screenshot_dir() -> Path:
    if os.environ.get("DIPTYCH_DASHBOARD_SCREENSHOTS"):
        return DOCS
    dashboard.ARTIFACTS.mkdir(exist_ok=True)
    return dashboard.ARTIFACTS


def new_page(browser, live, viewport: dict) -> Page:
    return browser.new_context(base_url=live.stack.control_plane_url, viewport=viewport).new_page()


@pytest.fixture
def page(browser, live):
    page = new_page(browser, live, DESKTOP)
    yield page
    page.context.close()


@pytest.fixture
def phone(browser, live):
    page = new_page(browser, live, PHONE)
    yield page
    page.context.close()


def new_organization(control_plane_shell, name: str) -> dict:
    """An organization of its own with an owner who signs in to the dashboard and an API key."""
    slug = f"{name.lower()}-{uuid.uuid4().hex[:8]}"
    owner = {"email": f"owner@{slug}.test", "password": secrets.token_urlsafe(12)}
    output = control_plane_shell(
        "import json\n"
        "from controlplane.tenancy.models import Scope\n"
        "from controlplane.tenancy.services import api_key_create, member_add, organization_ensure, user_ensure\n"
        f"organization = organization_ensure(name={name!r}, slug={slug!r})\n"
        "issued = api_key_create(organization=organization, name='production', scopes=Scope.values)\n"
        f"user_ensure(email={owner['email']!r}, password={owner['password']!r})\n"
        f"member_add(organization=organization, email={owner['email']!r}, role='owner')\n"
        "print(json.dumps({'organization_id': organization.public_id, 'api_key_id': issued.api_key.public_id}))\n"
    )
    return {**json.loads(output.strip().splitlines()[-1]), **owner}


def period_moments() -> tuple[datetime.datetime, datetime.datetime]:
    """The open period's first hour and a minute ago (the same day on the 1st of a month)."""
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)
    return now.replace(day=1, hour=0, minute=30, second=0, microsecond=0), now


def period_text(today: datetime.date) -> str:
    last = (today.replace(day=28) + datetime.timedelta(days=4)).replace(day=1) - datetime.timedelta(days=1)
    return f"1 – {last.day} {last:%B %Y}"


# (moment, phase, tier, tokens, cached tokens) as the gateway reports them; the cost of each billed phase by hand.
def usage_of(first: datetime.datetime, now: datetime.datetime) -> list[tuple]:
    return [
        (first, "prefill", "standard", 1_000_000, 250_000),
        (first, "decode", "standard", 500_000, 0),
        (now, "decode", "batch", 200_000, 0),
    ]


def expected_rows(first: datetime.datetime, now: datetime.datetime) -> list[tuple]:
    """(day, phase, tier, tokens, µ$) per billed phase: computed prompt tokens, cached ones, output tokens."""
    day, today = first.date().isoformat(), now.date().isoformat()
    billed = [
        (day, "prefill", "standard", 750_000, PRICES["prefill"]),
        (day, "cached_prefill", "standard", 250_000, PRICES["cached_prefill"]),
        (day, "decode", "standard", 500_000, PRICES["decode"]),
        (today, "decode", "batch", 200_000, BATCH_DECODE_PRICE),
    ]
    return sorted((*row[:4], row[3] * row[4] // 1_000_000) for row in billed)


def ingest(live, organization: dict, usage: list[tuple]) -> None:
    events = []
    for moment, phase, tier, tokens, cached in usage:
        events.append(
            {
                "request_id": f"req_costs_{secrets.token_hex(6)}",
                "phase": phase,
                "tier": tier,
                "organization_id": organization["organization_id"],
                "api_key_id": organization["api_key_id"],
                "model": MODEL,
                "region": "local",
                "worker_id": live.workers[f"{phase}-0"]["id"],
                "tokens": tokens,
                "cached_tokens": cached,
                "kv_bytes": 0,
                "compute_ms": 5,
                "started_at": moment.isoformat(),
                "finished_at": (moment + datetime.timedelta(seconds=1)).isoformat(),
            }
        )
    with live.internal() as internal:
        answer = internal.post("/usage-events", json={"events": events})
    assert answer.status_code == 200 and answer.json()["accepted"] == len(events), answer.text


@pytest.fixture(scope="module")
def spender(live, control_plane_shell) -> dict:
    """An organization with usage this period, rolled up."""
    organization = new_organization(control_plane_shell, "Spender")
    ingest(live, organization, usage_of(*period_moments()))
    control_plane_shell("from controlplane.billing.tasks import roll_up_usage; roll_up_usage()")
    return organization


def money(micros: int) -> str:
    """As the page writes it: dollars with 2 to 6 decimals."""
    text = f"{micros // 1_000_000:,}.{micros % 1_000_000:06d}".rstrip("0")
    return "$" + text + "0" * (2 - len(text.split(".")[1]))


def test_cost_per_phase_and_day_of_the_open_period(page, spender):
    first, now = period_moments()
    rows = expected_rows(first, now)
    sign_in(page, spender["email"], spender["password"])
    costs = page.locator("#costs")
    expect(costs.locator("[data-period]")).to_contain_text(period_text(now.date()))
    expect(page.locator("[data-billing=period]")).to_have_text(period_text(now.date()))

    by_phase = costs.locator("[data-table=phase-costs]")
    for phase, label in (("prefill", "Prefill"), ("cached_prefill", "Cached prefill"), ("decode", "Decode")):
        tokens = sum(row[3] for row in rows if row[1] == phase)
        amount = sum(row[4] for row in rows if row[1] == phase)
        row = by_phase.locator("tr", has=page.locator(f"td:text-is('{label}')"))
        expect(row).to_contain_text(f"{tokens:,}")
        expect(row).to_contain_text(money(amount))
    total = sum(row[4] for row in rows)
    expect(by_phase.locator("tr", has_text="Total")).to_contain_text(money(total))
    expect(page.locator("[data-billing=to-date]")).to_contain_text(money(total))

    plotted = {
        (day, dataset["label"]): round(value * 1_000_000)
        for dataset in chart(page, "cost")["datasets"]
        for day, value in zip(chart(page, "cost")["labels"], dataset["data"], strict=True)
        if value
    }
    labels = {"prefill": "Prefill", "cached_prefill": "Cached prefill", "decode": "Decode"}
    by_day: dict[tuple[str, str], int] = {}
    for day, phase, _, _, amount in rows:
        by_day[(day, labels[phase])] = by_day.get((day, labels[phase]), 0) + amount
    assert plotted == by_day
    assert chart(page, "cost")["labels"][0] == first.date().isoformat()
    assert chart(page, "cost")["labels"][-1] == now.date().isoformat()

    with page.expect_download() as download:
        costs.get_by_role("button", name="Download CSV").click()
    assert download.value.suggested_filename == f"diptych-usage-{now:%Y-%m}.csv"
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0] == "day,model,phase,tier,tokens,cost_usd"
    ordered = sorted(rows, key=lambda row: (row[0], MODEL, row[1], row[2]))
    assert lines[1:] == [
        f"{day},{MODEL},{phase},{tier},{tokens},{amount // 1_000_000}.{amount % 1_000_000:06d}"
        for day, phase, tier, tokens, amount in ordered
    ]


def test_no_usage_yet_shows_an_empty_state(page, live, control_plane_shell):
    newcomer = new_organization(control_plane_shell, "Newcomer")
    sign_in(page, newcomer["email"], newcomer["password"])
    expect(page.locator("#costs [data-empty=costs]")).to_contain_text("No usage yet this period")
    expect(page.locator("#usage [data-empty=usage]")).to_contain_text("No usage in the last 14 days")
    expect(page.locator("#costs").get_by_role("button", name="Download CSV")).to_have_count(0)


def test_a_failed_section_shows_the_error_and_a_retry_that_loads_it(page, spender):
    page.route("**/api/v1/billing/current/costs", lambda route: route.abort("connectionrefused"))
    sign_in(page, spender["email"], spender["password"])
    costs = page.locator("#costs")
    expect(costs.get_by_role("alert")).to_contain_text("Failed to fetch")
    expect(page.locator("#billing [data-billing=to-date]")).to_be_visible()  # the other sections still load
    page.unroute("**/api/v1/billing/current/costs")
    costs.get_by_role("button", name="Retry").click()
    expect(costs.locator("[data-table=phase-costs]")).to_contain_text("Total")
    expect(costs.get_by_role("alert")).to_have_count(0)


def fits(page: Page) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    wide = page.evaluate(
        """() => [...document.querySelectorAll('body *')]
                 .filter(e => e.getBoundingClientRect().right > innerWidth + 0.5)
                 .slice(0, 5).map(e => e.tagName + '.' + e.className)"""
    )
    assert width <= PHONE["width"], f"the page is {width} px wide at {PHONE['width']} px; too wide: {wide}"


def test_every_view_fits_a_phone_and_is_screenshotted_at_both_widths(phone, page, spender, passwords):
    shots = screenshot_dir()
    phone.goto("/dashboard/")
    expect(phone.get_by_role("button", name="Sign in")).to_be_visible()
    fits(phone)
    phone.screenshot(path=str(shots / "dashboard-phone-sign-in.png"))

    sign_in(phone, spender["email"], spender["password"])
    expect(phone.locator("#costs [data-table=phase-costs]")).to_be_visible()
    fits(phone)
    phone.screenshot(path=str(shots / "dashboard-phone.png"), full_page=True)

    phone.get_by_role("button", name="Sign out").click()
    sign_in(phone, dashboard.STAFF_EMAIL, passwords[dashboard.STAFF_EMAIL])
    expect(phone.locator("[data-table=workers] tr", has_text="decode-0")).to_be_visible()
    fits(phone)
    phone.screenshot(path=str(shots / "dashboard-phone-staff.png"), full_page=True)

    sign_in(page, spender["email"], spender["password"])
    expect(page.locator("#costs [data-table=phase-costs]")).to_be_visible()
    page.screenshot(path=str(shots / "dashboard-desktop.png"), full_page=True)
