"""The dashboard says each thing one way, in a real browser (Playwright driving Debian's Chromium) against the
live stack: an API key's prefix and its "revoked" badge each on one line at a desktop's width (and nothing wider
than its box at a phone's); the period's spend the same in every section, however its rows round; every date in
one format, YYYY-MM-DD, the range's days included."""

import datetime
import re

import pytest
from playwright.sync_api import Page, expect

from tests.e2e import test_dashboard as dashboard
from tests.e2e import test_dashboard_costs as costs

browser = dashboard.browser
busy = costs.busy
sign_in = dashboard.sign_in

pytestmark = costs.pytestmark

# The line boxes of an element's text: one per line it takes on the page.
LINES = """element => { const range = document.createRange(); range.selectNodeContents(element);
                        return new Set([...range.getClientRects()].map(rect => Math.round(rect.top))).size; }"""


@pytest.fixture
def page(browser, live):
    page = costs.new_page(browser, live, costs.DESKTOP)
    yield page
    page.context.close()


def test_key_prefixes_and_revoked_badges_take_one_line_at_a_desktop_s_width_and_fit_a_phone_s(browser, live, busy):
    for viewport in (costs.DESKTOP, costs.PHONE):
        page = costs.new_page(browser, live, viewport)
        sign_in(page, busy["email"], busy["password"])
        keys = page.locator("[data-table=api-keys]")
        expect(keys.locator(".badge.revoked")).to_have_count(1)
        prefixes = keys.locator("code.key-prefix")
        assert prefixes.count() == 3  # production, the long name and the revoked one
        if viewport is costs.DESKTOP:
            for element in [*prefixes.all(), keys.locator(".badge.revoked")]:
                assert element.evaluate(LINES) == 1, f"{element.inner_text()!r} wraps at {viewport['width']} px"
        costs.fits(page)
        page.context.close()


# (moment, phase, tier, tokens, cached tokens): every line and every day's row a fraction of a micro-dollar.
def half_micros_usage(first: datetime.datetime, now: datetime.datetime) -> list[tuple]:
    return [
        (first, "prefill", "standard", 25, 20),  # 5 computed prompt tokens (0.5 µ$), 20 cached (0.5 µ$)
        (first, "decode", "standard", 1, 0),  # 0.4 µ$
        (now, "decode", "standard", 1, 0),  # 0.4 µ$
        (now, "decode", "batch", 3, 0),  # 0.6 µ$
    ]


def test_the_period_s_spend_is_the_same_in_every_section_however_its_rows_round(page, live, control_plane_shell):
    spender = costs.new_organization(control_plane_shell, "Rounding")
    first, now = costs.period_moments()
    costs.ingest(live, spender, half_micros_usage(first, now))
    control_plane_shell("from controlplane.billing.tasks import roll_up_usage; roll_up_usage()")
    # Each line rounded once, as the invoice rounds: 1 + 1 + 1 + 1 µ$; the day × key rows, rounded one by one and
    # added, make 2 µ$ (1.4 and 1.0, or 2.4 on the 1st of a month).
    spend = costs.money(4)
    sign_in(page, spender["email"], spender["password"])
    expect(page.locator("#costs [data-table=phase-costs] tr", has_text="Total")).to_contain_text(spend)
    expect(page.locator("[data-billing=to-date]")).to_contain_text(spend)

    page.get_by_label("From", exact=True).fill(first.date().isoformat())  # the range is the period so far
    page.get_by_label("To", exact=True).fill(now.date().isoformat())
    expect(page.locator("#app[data-state=ready]")).to_be_attached()
    expect(page.locator("#usage h3").first).to_have_text(re.compile(r"By API key, (today|the last \d+ days)"))
    for table in ("key-totals", "project-totals", "model-totals"):
        rows = page.locator(f"#usage [data-table={table}] tbody tr")
        expect(rows).to_have_count(2)  # the one key (project, model) and the total
        expect(rows.nth(0).locator("td").nth(3)).to_have_text(spend)
        expect(rows.nth(1).locator("td").nth(3)).to_have_text(spend)


DAY = r"\d{4}-\d{2}-\d{2}"
MOMENT = rf"{DAY} \d{{2}}:\d{{2}} UTC"
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


def shown_text(page: Page) -> str:
    page.evaluate("document.querySelectorAll('details').forEach(details => { details.open = true; })")
    return page.locator("main").inner_text()


def test_every_date_is_written_yyyy_mm_dd_the_range_s_days_included(page, busy):
    sign_in(page, busy["email"], busy["password"])
    first, now = costs.period_moments()
    expect(page.locator("[data-billing=period]")).to_have_text(re.compile(rf"^{first.date().isoformat()} – {DAY}$"))
    expect(page.locator("#costs [data-period]")).to_have_text(
        re.compile(rf"^{DAY} – {DAY} · usage counted until {MOMENT}$")
    )
    keys = page.locator("[data-table=api-keys] tbody tr")
    for row in keys.all():
        expect(row.locator("td").nth(3)).to_have_text(re.compile(rf"^{MOMENT}$"))  # created
        expect(row.locator("td").nth(4)).to_have_text(re.compile(rf"^({MOMENT}|never)$"))  # last used
    expect(page.locator("[data-table=api-keys] .badge.revoked")).to_have_text(re.compile(rf"^revoked {MOMENT}$"))
    expect(page.locator("#refusals [data-table=refusals] tbody tr").first.locator("td").first).to_have_text(
        re.compile(rf"^{DAY}$")
    )
    assert all(re.fullmatch(DAY, label) for label in dashboard.chart(page, "api_key")["labels"])

    # The range's days are text in the same format: a browser's date field would show its own locale's instead.
    assert page.locator("[data-range] input[type=date]").count() == 0
    start, end = page.get_by_label("From", exact=True), page.get_by_label("To", exact=True)
    expect(start).to_have_value(re.compile(rf"^{DAY}$"))
    expect(end).to_have_value(now.date().isoformat())

    text = shown_text(page)
    assert not re.search(r"\b\d{1,2}/\d{1,2}/\d{2,4}\b", text), "a date written with slashes"
    assert not [month for month in MONTHS if re.search(rf"\b{month[:3]}\b|\b{month}\b", text)], "a month by name"


def test_a_range_day_that_is_not_one_is_refused_with_the_reason_and_changes_nothing(page, busy):
    sign_in(page, busy["email"], busy["password"])
    headings = page.locator("#usage h3").all_inner_texts()
    start = page.get_by_label("From", exact=True)
    for typed in ("2026-02-30", "18/11/2026", "2026-1-5"):
        start.fill(typed)
        start.blur()
        expect(page.locator("[data-range] [role=alert]")).to_have_text("Write each day as YYYY-MM-DD, e.g. 2026-11-18.")
        assert page.locator("#usage h3").all_inner_texts() == headings
    start.fill("2020-01-01")  # a whole day, too far back
    expect(page.locator("[data-range] [role=alert]")).to_have_text(
        "Choose a first day before the last, at most 366 days apart."
    )
    assert page.locator("#usage h3").all_inner_texts() == headings
