"""The dashboard's Requests view in a real browser (Playwright driving Debian's Chromium) against the live stack:
requests sent through the split and the colocated gateway show in the log by the id the gateway answered them
with (X-Request-Id), and the selected one's phases on a time line, at a desktop's and a phone's width.

With DIPTYCH_DASHBOARD_SCREENSHOTS=1 the time line's screenshots at both widths are written to docs/images/
(docs/dashboard-requests.md shows them), otherwise to tests/artifacts/:

    DIPTYCH_DASHBOARD_SCREENSHOTS=1 .venv/bin/pytest tests/e2e/test_dashboard_requests.py
"""

import json
import secrets
import uuid

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e import test_dashboard as dashboard
from tests.e2e import test_dashboard_costs as costs
from tests.e2e.waiting import wait_for

browser = dashboard.browser
chart = dashboard.chart
page = costs.page

pytestmark = costs.pytestmark


@pytest.fixture(scope="module")
def requester(live, control_plane_shell) -> dict:
    """An organization of its own, one request through each gateway, and each request's answer id."""
    slug = f"requester-{uuid.uuid4().hex[:8]}"
    owner = {"email": f"owner@{slug}.test", "password": secrets.token_urlsafe(12)}
    output = control_plane_shell(
        "import json\n"
        "from controlplane.tenancy.models import Scope\n"
        "from controlplane.tenancy.services import api_key_create, member_add, organization_ensure, user_ensure\n"
        f"organization = organization_ensure(name='Requester', slug={slug!r})\n"
        "issued = api_key_create(organization=organization, name='production', scopes=Scope.values)\n"
        f"user_ensure(email={owner['email']!r}, password={owner['password']!r})\n"
        f"member_add(organization=organization, email={owner['email']!r}, role='owner')\n"
        "print(json.dumps({'key': issued.key}))\n"
    )
    organization = {**json.loads(output.strip().splitlines()[-1]), **owner}
    for mode in ("split", "colocated"):
        answer = httpx.post(
            f"{live.http_urls[mode]}/completions",
            headers={"Authorization": f"Bearer {organization['key']}"},
            json={"model": costs.MODEL, "prompt": [9] * 90, "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        request_id = answer.headers["X-Request-Id"]
        assert request_id.startswith("exec_"), request_id
        organization[mode] = request_id
    with live.rest(organization["key"]) as rest:
        for mode in ("split", "colocated"):
            found = wait_for(lambda mode=mode: rest.get(f"/usage/requests/{organization[mode]}").status_code == 200, 20)
            assert found, f"the {mode} request never reached the ledger"
        organization["details"] = {
            mode: rest.get(f"/usage/requests/{organization[mode]}").json() for mode in ("split", "colocated")
        }
    return organization


def sign_in(page: Page, organization: dict) -> None:
    """Signed in, with the Requests section loaded (the other sections load on their own)."""
    page.goto("/dashboard/")
    page.get_by_label("Email").fill(organization["email"])
    page.get_by_label("Password").fill(organization["password"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#requests [data-table=request-log]")).to_be_visible()


def overflowing_requests(page: Page) -> list[str]:
    """Each box of the Requests section wider than itself, and the page if it scrolls sideways."""
    page.evaluate("document.querySelectorAll('#requests details').forEach(details => { details.open = true; })")
    boxes = "#requests, " + ", ".join(f"#requests {box}" for box in costs.BOXES.split(", "))
    return page.evaluate(
        """boxes => [...document.querySelectorAll(boxes)]
             .filter(box => box.scrollWidth > box.clientWidth + 1)
             .map(box => `${box.tagName.toLowerCase()}.${box.className}: `
                         + `${box.scrollWidth} px in ${box.clientWidth} px`)
             .concat(document.documentElement.scrollWidth > window.innerWidth
                     ? [`page: ${document.documentElement.scrollWidth} px in ${window.innerWidth} px`] : [])""",
        boxes,
    )


def select(page: Page, request_id: str) -> None:
    page.locator(f"[data-request-id='{request_id}']").click()
    expect(page.locator(f"[data-request='{request_id}']")).to_be_visible()


def plotted_bars(page: Page) -> list[tuple[str, float, float]]:
    timeline = chart(page, "timeline")
    return [(label, *bar) for label, bar in zip(timeline["labels"], timeline["datasets"][0]["data"], strict=True)]


def test_each_request_shows_its_phases_on_a_time_line(page, requester):
    sign_in(page, requester)
    log = page.locator("#requests [data-table=request-log]")
    for mode in ("split", "colocated"):
        expect(log).to_contain_text(requester[mode])

    split = requester["details"]["split"]
    assert split["route"] == "split"
    select(page, requester["split"])
    prefill, handoff, decode = split["phases"]
    assert [bar[0] for bar in plotted_bars(page)] == ["Queued", "Prefill", "KV hand-off", "Decode"]
    queued, computing, moving, decoding = plotted_bars(page)
    assert queued[1:] == pytest.approx((0, prefill["queued_ms"]))
    assert computing[2] == pytest.approx(prefill["duration_ms"])
    assert moving[1:] == pytest.approx((handoff["offset_ms"], handoff["offset_ms"] + handoff["duration_ms"]))
    assert decoding[2] == pytest.approx(decode["offset_ms"] + decode["duration_ms"])
    phases = page.locator("[data-table=phases]")
    expect(phases.locator("tr", has_text="Prefill")).to_contain_text(prefill["worker_id"])
    expect(phases.locator("tr", has_text="Decode")).to_contain_text(decode["worker_id"])
    expect(phases.locator("tr", has_text="KV hand-off")).to_contain_text("iB")
    expect(page.locator("[data-stat=tokens]")).to_have_text(f"90 / {split['totals']['output_tokens']}")

    colocated = requester["details"]["colocated"]
    assert colocated["route"] == "colocated"
    select(page, requester["colocated"])
    assert [bar[0] for bar in plotted_bars(page)] == ["Queued", "Colocated"]
    expect(page.locator("[data-table=phases]")).to_contain_text(colocated["phases"][0]["worker_id"])


def test_latency_percentiles_per_day_are_those_of_the_api(page, live, requester):
    sign_in(page, requester)
    expect(page.locator("[data-chart=latency_ttft]")).to_be_visible()
    with live.rest(requester["key"]) as rest:
        today = requester["details"]["split"]["started_at"][:10]
        (row,) = rest.get("/usage/latency", params={"start": today, "end": today}).json()["data"]
    plotted = chart(page, "latency_ttft")
    assert [dataset["label"] for dataset in plotted["datasets"]] == ["p50", "p90", "p99"]
    day = plotted["labels"].index(today)
    assert [dataset["data"][day] for dataset in plotted["datasets"]] == pytest.approx(
        [row["time_to_first_token_ms"][name] for name in ("p50", "p90", "p99")]
    )
    assert row["requests"] == 2


def test_the_time_line_fits_at_both_widths_and_is_screenshotted(browser, live, requester):
    shots = costs.screenshot_dir()
    for viewport in (costs.DESKTOP, costs.PHONE):
        page = costs.new_page(browser, live, viewport)
        sign_in(page, requester)
        select(page, requester["split"])
        assert overflowing_requests(page) == [], f"at {viewport['width']} px"
        page.locator("#requests .request-detail").screenshot(
            path=str(shots / f"requests-timeline-{viewport['width']}.png")
        )
        page.context.close()
