"""The dashboard's cost of the open period, its empty states and errors, every section's width at a desktop's and
a phone's width, and a page load that logs no error, in a real browser (Playwright driving Debian's Chromium)
against the live stack.

Each test here signs in to an organization of its own, whose usage the test ingested the way the gateway reports
it, so the page must show exactly these figures. With DIPTYCH_DASHBOARD_SCREENSHOTS=1 the screenshots at both
widths are written to docs/images/, otherwise to tests/artifacts/:

    DIPTYCH_DASHBOARD_SCREENSHOTS=1 .venv/bin/pytest tests/e2e/test_dashboard_costs.py -k widths
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

DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1440, "height": 900}
MODEL = "diptych-tiny"
PRICES = {"prefill": 100_000, "cached_prefill": 25_000, "decode": 400_000}  # bootstrap's, µ$ per million tokens
BATCH_DECODE_PRICE = PRICES["decode"] // 2

pytestmark = [
    pytest.mark.skipif(not dashboard.CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(not dashboard.DIST.exists(), reason="needs the dashboard bundle: make install"),
]


def screenshot_dir() -> Path:
    if os.environ.get("DIPTYCH_DASHBOARD_SCREENSHOTS"):
        DOCS_IMAGES.mkdir(exist_ok=True)
        return DOCS_IMAGES
    dashboard.ARTIFACTS.mkdir(exist_ok=True)
    return dashboard.ARTIFACTS


def new_page(browser, live, viewport: dict) -> Page:
    return browser.new_context(base_url=live.stack.control_plane_url, viewport=viewport).new_page()


@pytest.fixture
def page(browser, live):
    page = new_page(browser, live, DESKTOP)
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
    return f"{today.replace(day=1).isoformat()} – {last.isoformat()}"


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


# Every box that must hold its content: a section, its body, a table's box, a form, the charts and cards.
BOXES = "section, .section-body, .table-scroll, form, fieldset, .charts, .cards, .range, .topbar, details"


def overflowing(page: Page) -> list[str]:
    """Each box (and the page) whose content is wider than itself: hidden columns, or a page that scrolls sideways."""
    return page.evaluate(
        """boxes => [document.documentElement, ...document.querySelectorAll(boxes)]
             .filter(box => box.scrollWidth > box.clientWidth + 1)
             .map(box => `${box.closest('section')?.id ?? 'page'} ${box.tagName.toLowerCase()}.${box.className}: `
                         + `${box.scrollWidth} px of content in ${box.clientWidth} px`)""",
        BOXES,
    )


def fits(page: Page) -> None:
    """Every section shows all its content at the page's width: no box wider than itself, the page included."""
    page.evaluate("document.querySelectorAll('details').forEach(details => { details.open = true; })")
    assert overflowing(page) == [], f"at {page.viewport_size['width']} px"
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


@pytest.fixture(scope="module")
def busy(live, control_plane_shell) -> dict:
    """An organization whose lists are long: keys with long names and every scope, a revoked one, a batch (and its
    runner key), refusals by a rate limit, usage this period."""
    organization = new_organization(control_plane_shell, "Busy")
    output = control_plane_shell(
        "import json\n"
        "from controlplane.batches.services import batch_create, file_upload\n"
        "from controlplane.tenancy.models import Organization, Scope\n"
        "from controlplane.tenancy.services import api_key_create, api_key_revoke\n"
        f"organization = Organization.objects.get(public_id={organization['organization_id']!r})\n"
        "for name in ('nightly-evaluation-pipeline-europe-west-with-a-long-name', 'retired-integration-key'):\n"
        "    issued = api_key_create(organization=organization, name=name, scopes=Scope.values)\n"
        "api_key_revoke(api_key=issued.api_key)\n"
        f"content = {BATCH_LINE!r}.encode()\n"
        "file = file_upload(organization=organization, filename='in.jsonl', content=content, purpose='batch')\n"
        "batch = batch_create(organization=organization, input_file_id=file.public_id,"
        " endpoint='/v1/chat/completions', completion_window='24h')\n"
        "print(json.dumps({'runner_key_id': batch.runner_key.public_id, 'runner_key_name': batch.runner_key.name}))\n"
    )
    organization.update(json.loads(output.strip().splitlines()[-1]))
    first, now = period_moments()
    ingest(live, organization, usage_of(first, now))
    ingest(live, {**organization, "api_key_id": organization["runner_key_id"]}, [(now, "decode", "batch", 1000, 0)])
    refusals = [
        {
            "id": f"busy{secrets.token_hex(8)}",
            "organization_id": organization["organization_id"],
            "api_key_id": organization["api_key_id"],
            "scope": scope,
            "limit": limit,
            "limit_value": 3,
            "minute": now.replace(second=0, microsecond=0).isoformat(),
            "refusals": 7,
        }
        for scope, limit in (("api_key", "requests_per_minute"), ("organization", "output_tokens_per_minute"))
    ]
    with live.internal() as internal:
        assert internal.post("/rate-limit-refusals", json={"refusals": refusals}).status_code == 200
    control_plane_shell("from controlplane.billing.tasks import roll_up_usage; roll_up_usage()")
    return organization


BATCH_LINE = (
    '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
    '"body": {"model": "diptych-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}\n'
)


def test_batch_runner_keys_stay_out_of_the_lists_and_batches_show_as_one_key(page, busy):
    sign_in(page, busy["email"], busy["password"])
    runner = busy["runner_key_name"]
    expect(page.locator("[data-table=api-keys]")).to_contain_text("retired-integration-key")
    expect(page.locator("[data-table=api-keys]")).not_to_contain_text(runner)
    expect(page.locator("[data-table=limits]")).not_to_contain_text(runner)
    options = page.get_by_label("Limits of").locator("option").all_inner_texts()
    assert options and not [option for option in options if runner in option or "batch runner" in option]
    labels = [dataset["label"] for dataset in chart(page, "api_key")["datasets"]]
    assert "Batch API (all batches)" in labels and not [label for label in labels if busy["runner_key_id"] in label]
    totals = page.locator("[data-table=key-totals]")
    expect(totals.locator("tr", has_text="Batch API (all batches)")).to_contain_text("1,000")
    listed = page.evaluate("fetch('/api/v1/api-keys?kind=batch_runner').then(answer => answer.json())")
    assert [key["id"] for key in listed["data"]] == [busy["runner_key_id"]]  # still listed when asked for


def test_spend_requests_and_refusals_per_key_over_a_chosen_range(page, busy):
    sign_in(page, busy["email"], busy["password"])
    first, now = period_moments()
    refused = page.locator("#refusals [data-table=refusals]")
    expect(refused.locator("tr", has_text="Key requests / min: 3")).to_contain_text("7")
    expect(refused.locator("tr", has_text="Organization output tokens / min: 3")).to_contain_text("production")

    # The range goes back a year, beyond the open period, to the period's first usage.
    year_ago = (now - datetime.timedelta(days=365)).date()
    page.get_by_label("From", exact=True).fill(year_ago.isoformat())
    expect(page.locator("#usage h3")).to_have_text(
        ["By API key, the last 366 days", "By project, the last 366 days", "By model, the last 366 days"]
    )
    production = page.locator("[data-table=key-totals] tr", has_text="production")
    expect(production).to_contain_text(f"{sum(row[3] for row in usage_of(first, now)):,}")  # tokens
    expect(production).to_contain_text(money(sum(row[4] for row in expected_rows(first, now))))  # spend
    expect(production.locator("td").nth(1)).to_have_text("3")  # requests
    assert chart(page, "api_key")["labels"][0] == year_ago.isoformat()

    # Two days of last year hold none of it.
    page.get_by_label("To", exact=True).fill((year_ago + datetime.timedelta(days=1)).isoformat())
    expect(page.locator("#usage [data-empty=usage]")).to_be_visible()
    expect(page.locator("#refusals [data-empty=refusals]")).to_be_visible()


def console_problems(page: Page) -> list[str]:
    """Errors the browser logs from now on, and every answer of 400 or more (a 404 favicon, a 401 session check)."""
    problems: list[str] = []
    page.on("console", lambda message: message.type == "error" and problems.append(f"console: {message.text}"))
    page.on("response", lambda answer: answer.status >= 400 and problems.append(f"{answer.status} {answer.url}"))
    return problems


def test_no_error_is_logged_before_or_after_sign_in(page, busy):
    problems = console_problems(page)
    page.goto("/dashboard/")
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    page.wait_for_load_state("networkidle")
    assert problems == []
    expect(page.locator("link[rel=icon]")).to_have_count(1)  # headless Chromium fetches no icon: ask for it
    assert page.request.get(page.locator("link[rel=icon]").get_attribute("href")).status == 200
    sign_in(page, busy["email"], busy["password"])
    page.wait_for_load_state("networkidle")
    assert problems == []


def test_every_section_fits_at_both_widths_and_is_screenshotted(browser, live, busy, passwords):
    shots = screenshot_dir()
    for viewport in (DESKTOP, PHONE):
        width = viewport["width"]
        page = new_page(browser, live, viewport)
        page.goto("/dashboard/")
        expect(page.get_by_role("button", name="Sign in")).to_be_visible()
        fits(page)
        page.screenshot(path=str(shots / f"dashboard-{width}-sign-in.png"))

        sign_in(page, busy["email"], busy["password"])
        expect(page.locator("#costs [data-table=phase-costs]")).to_be_visible()
        page.screenshot(path=str(shots / f"dashboard-{width}.png"), full_page=True)
        fits(page)

        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_role("button", name="Sign in")).to_be_visible()  # signed out before the next page load
        sign_in(page, dashboard.STAFF_EMAIL, passwords[dashboard.STAFF_EMAIL])
        expect(page.locator("[data-table=workers] tr", has_text="decode-0")).to_be_visible()
        page.screenshot(path=str(shots / f"dashboard-{width}-staff.png"), full_page=True)
        fits(page)
        page.context.close()
