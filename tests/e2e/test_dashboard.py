"""The dashboard in a real browser (Playwright driving Debian's Chromium) against the live stack.

Requests go through the real gateway; the charts must show exactly the tokens they used.
"""

import datetime
import secrets
from functools import partial
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

import diptych
from tests.e2e.waiting import wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
DIST = Path(__file__).resolve().parents[2] / "frontend" / "dist" / "index.html"
MODEL = "diptych-tiny"
MEMBER_EMAIL = "demo@diptych.local"
STAFF_EMAIL = "staff@diptych.local"

expect.set_options(timeout=15_000)  # the machine may be busy with the rest of the suite

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(not DIST.exists(), reason="needs the dashboard bundle: make install (npm ci && npm run build)"),
]


@pytest.fixture(scope="module")
def passwords(control_plane_shell) -> dict[str, str]:
    """Sets the demo owner's password and creates a staff user, through the control plane's own service."""
    chosen = {MEMBER_EMAIL: secrets.token_urlsafe(12), STAFF_EMAIL: secrets.token_urlsafe(12)}
    control_plane_shell(
        "from controlplane.tenancy.services import user_ensure\n"
        f"user_ensure(email={MEMBER_EMAIL!r}, password={chosen[MEMBER_EMAIL]!r})\n"
        f"user_ensure(email={STAFF_EMAIL!r}, password={chosen[STAFF_EMAIL]!r}, is_staff=True)\n"
    )
    return chosen


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, live):
    context = browser.new_context(base_url=live.stack.control_plane_url, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    yield page
    context.close()


def sign_in(page: Page, email: str, password: str) -> None:
    page.goto("/dashboard/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#app[data-state=ready]")).to_be_attached(timeout=15_000)


def chart(page: Page, name: str) -> dict:
    return page.evaluate(
        """name => { const c = window.diptychCharts[name];
                     const datasets = c.data.datasets.map(d => ({label: d.label, data: d.data}));
                     return {labels: c.data.labels, datasets}; }""",
        name,
    )


def roll_up_usage(live, control_plane_shell, request_ids: list[str]) -> None:
    with live.rest() as rest:
        for request_id in request_ids:
            assert wait_for(
                lambda request_id=request_id: (
                    len(rest.get("/usage-events", params={"request_id": request_id}).json()["data"]) >= 2
                )
            )
    control_plane_shell("from controlplane.billing.tasks import roll_up_usage; roll_up_usage()")


def test_dashboard_is_served_with_a_csrf_cookie(live):
    base = live.stack.control_plane_url
    page = httpx.get(f"{base}/dashboard/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "csrftoken" in page.cookies
    (script,) = [part.split('"')[0] for part in page.text.split('src="')[1:]]
    asset = httpx.get(f"{base}{script}", timeout=10)
    assert asset.status_code == 200 and "javascript" in asset.headers["content-type"]
    escape = httpx.get(f"{base}/dashboard/assets/%2E%2E/%2E%2E/%2E%2E/manage.py", timeout=10)
    assert escape.status_code == 404 and "DJANGO_SETTINGS_MODULE" not in escape.text
    assert httpx.get(f"{base}/dashboard/assets/missing.js", timeout=10).status_code == 404
    assert httpx.post(f"{base}/dashboard/", timeout=10).status_code == 403  # no CSRF token


def test_wrong_password_is_refused_on_the_page(page, passwords):
    page.goto("/dashboard/")
    page.get_by_label("Email").fill(MEMBER_EMAIL)
    page.get_by_label("Password").fill("not-the-password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).not_to_be_empty()
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()


def test_member_creates_a_key_sees_its_usage_in_the_charts_and_revokes_it(page, live, passwords, control_plane_shell):
    sign_in(page, MEMBER_EMAIL, passwords[MEMBER_EMAIL])
    expect(page.locator("[data-organization]")).not_to_have_text("no organization")
    expect(page.locator("#fleet")).to_have_count(0)  # fleets are for staff only
    # every section loaded (the shared stack's organization holds the usage of the tests before this one)
    expect(page.locator("#app[data-state=ready]")).to_be_attached(timeout=60_000)

    page.get_by_label("Name", exact=True).fill("dashboard-test")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("[data-new-key]").inner_text()
    assert secret.startswith("dip_")
    page.get_by_role("button", name="Done").click()
    expect(page.locator("#app[data-state=ready]")).to_be_attached()
    row = page.locator("[data-table=api-keys] tr", has_text="dashboard-test")
    expect(row).to_contain_text("inference")
    expect(page.locator("[data-new-key]")).to_have_count(0)  # shown once

    # Real requests through the gateway with the new key: 3 prompts of 8 tokens, 5 output tokens each.
    request_ids = []
    with diptych.Client(api_key=secret, base_url=live.gateways["split"]) as client:
        for first in (3, 30, 300):
            completion = client.completions.create(
                model=MODEL, prompt=list(range(first, first + 8)), max_tokens=5, ignore_eos=True
            )
            assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (8, 5)
            request_ids.append(completion.id)
    roll_up_usage(live, control_plane_shell, request_ids)

    page.reload()
    expect(page.locator("#app[data-state=ready]")).to_be_attached(timeout=15_000)
    today = datetime.datetime.now(datetime.UTC).date().isoformat()

    by_key = chart(page, "api_key")
    assert by_key["labels"][-1] == today
    (ours,) = [dataset for dataset in by_key["datasets"] if dataset["label"].startswith("dashboard-test (")]
    assert ours["data"][-1] == 3 * (8 + 5) and sum(ours["data"]) == 3 * (8 + 5)

    # Every chart plots exactly what the usage API reports.
    start, end = by_key["labels"][0], by_key["labels"][-1]
    for name, labels in (
        ("phase", {"prefill": "Prefill", "cached_prefill": "Cached prefill", "decode": "Decode"}),
        ("model", {}),
    ):
        rows = page.evaluate(
            "url => fetch(url).then(r => r.json()).then(b => b.data)",
            f"/api/v1/usage/daily?start={start}&end={end}&group_by={name}",
        )
        plotted = {
            (day, dataset["label"]): tokens
            for dataset in chart(page, name)["datasets"]
            for day, tokens in zip(by_key["labels"], dataset["data"], strict=True)
            if tokens
        }
        assert plotted == {
            (row["day"], labels.get(row["key"], row["key"])): row["tokens"] for row in rows if row["tokens"]
        }
    phase_today = {dataset["label"]: dataset["data"][-1] for dataset in chart(page, "phase")["datasets"]}
    assert phase_today["Decode"] >= 15 and phase_today["Prefill"] + phase_today["Cached prefill"] >= 24
    assert MODEL in [dataset["label"] for dataset in chart(page, "model")["datasets"]]
    expect(page.locator("[data-chart-table=api_key]")).to_contain_text("dashboard-test")
    expect(page.locator("[data-billing=to-date]")).to_contain_text("$")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    revoke = row.get_by_role("button", name="Revoke")
    revoke.click()
    row.get_by_role("button", name="Confirm revoke").click()
    expect(page.locator("[data-table=api-keys] tr", has_text="dashboard-test")).to_contain_text("revoked")

    def refused_by_gateway() -> bool:
        with diptych.Client(api_key=secret, base_url=live.gateways["split"], max_retries=0) as client:
            try:
                client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
            except diptych.AuthenticationError:
                return True
        return False

    assert wait_for(refused_by_gateway, seconds=10, interval=0.5)


def test_spend_limit_and_its_alerts(page, live, passwords, control_plane_shell):
    control_plane_shell("from controlplane.billing.tasks import roll_up_usage; roll_up_usage()")
    with live.rest() as rest:
        spent = rest.get("/billing/current").json()["amount_to_date_micros"]
    sign_in(page, MEMBER_EMAIL, passwords[MEMBER_EMAIL])
    page.get_by_label("Spend limit per period (USD)").fill(
        f"{(spent + 1) / 1_000_000:.6f}"
    )  # the next request crosses it
    page.get_by_role("button", name="Save").click()
    shown = f"{(spent + 1) / 1_000_000:.6f}".rstrip("0")
    shown += "0" * (2 - len(shown.split(".")[1]))  # the page shows 2 to 6 decimals
    expect(page.locator("#billing .stat", has_text="Spend limit")).to_contain_text(f"${shown}")
    with live.rest() as rest:
        assert rest.get("/spend-limit").json() == {"limit_micros": spent + 1}

    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        completion = client.completions.create(
            model=MODEL, prompt=[4, 8, 15, 16, 23, 42], max_tokens=3, ignore_eos=True
        )
    roll_up_usage(live, control_plane_shell, [completion.id])
    page.reload()
    alerts = page.locator("#billing ul.alerts")
    expect(alerts).to_contain_text("80% of the spend limit reached")
    expect(alerts).to_contain_text("100% of the spend limit reached")

    page.get_by_label("Spend limit per period (USD)").fill("")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#billing .stat", has_text="Spend limit")).to_contain_text("none")

    def serves_again(base_url: str) -> bool:
        with diptych.Client(api_key=live.api_key, base_url=base_url, max_retries=0) as client:
            try:
                client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
            except diptych.RateLimitError:
                return False
        return True

    # Each gateway caches the key's spend status for a few seconds; the tests after this one need both.
    for base_url in live.gateways.values():
        assert wait_for(partial(serves_again, base_url), seconds=15, interval=0.5)


def test_invoices_show_their_lines_and_status(page, live, passwords, control_plane_shell):
    """Usage of last month, reported the way the gateway reports it, closed into an invoice by the billing job."""
    today = datetime.datetime.now(datetime.UTC)
    last_month = (today.replace(day=1) - datetime.timedelta(days=1)).replace(
        day=2, hour=12, minute=0, second=0, microsecond=0
    )
    with live.rest() as rest:
        api_key_id = next(key["id"] for key in rest.get("/api-keys").json()["data"] if key["name"] == "demo")
    event = {
        "organization_id": live.credentials.organization_id,
        "api_key_id": api_key_id,
        "model": MODEL,
        "region": "local",
        "worker_id": live.workers["prefill-0"]["id"],
        "cached_tokens": 0,
        "kv_bytes": 0,
        "compute_ms": 5,
        "started_at": last_month.isoformat(),
        "finished_at": (last_month + datetime.timedelta(seconds=1)).isoformat(),
    }
    request_id = f"req_invoice_{secrets.token_hex(6)}"
    with live.internal() as internal:
        answer = internal.post(
            "/usage-events",
            json={
                "events": [
                    {**event, "request_id": request_id, "phase": "prefill", "tokens": 1_000_000},
                    {**event, "request_id": request_id, "phase": "decode", "tokens": 2_000_000},
                ]
            },
        )
        assert answer.status_code == 200 and answer.json()["accepted"] == 2
    control_plane_shell(
        "from controlplane.billing.tasks import roll_up_usage, close_billing_periods\n"
        "roll_up_usage(); close_billing_periods()"
    )

    with diptych.Client(api_key=live.api_key, admin_url=live.stack.control_plane_url) as client:
        (invoice,) = [
            invoice for invoice in client.admin.invoices.list().data if invoice.period_start.month == last_month.month
        ]
        assert client.admin.invoices.retrieve(invoice.id) == invoice
    lines = {(line.phase, line.tokens) for line in invoice.lines}
    assert {("prefill", 1_000_000), ("decode", 2_000_000)} <= lines and invoice.total_cents > 0

    sign_in(page, MEMBER_EMAIL, passwords[MEMBER_EMAIL])
    entry = page.locator(f"[data-table=invoices] details[data-period-start='{invoice.period_start.isoformat()[:10]}']")
    last_day = invoice.period_end - datetime.timedelta(days=1)  # the page shows the period's last day, not its end
    expect(entry.locator("summary")).to_contain_text(
        f"{invoice.period_start.isoformat()[:10]} – {last_day.isoformat()[:10]}"
    )
    expect(entry.locator(".badge")).to_have_text(invoice.status)
    entry.locator("summary").click()
    expect(entry.locator("tr", has_text="decode")).to_contain_text("2,000,000")
    expect(entry.locator("tr", has_text="prefill")).to_contain_text("1,000,000")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-invoices.png"), full_page=True)


def test_staff_sees_fleets_and_workers_with_live_state(page, live, passwords):
    sign_in(page, STAFF_EMAIL, passwords[STAFF_EMAIL])
    workers = page.locator("[data-table=workers]")
    for name in live.workers:
        expect(workers.locator("tr", has_text=name)).to_contain_text("ready")
    expect(page.locator("[data-table=fleets]")).to_contain_text("prefill")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-staff.png"), full_page=True)
    signed_out = page.get_by_role("button", name="Sign out")
    signed_out.click()
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    assert page.evaluate("fetch('/api/v1/auth/me').then(r => r.status)") in (401, 403)


def test_staff_drains_a_worker_from_the_fleet_view(page, passwords, control_plane_shell):
    """A worker of a fleet of its own, in a region no gateway serves (no request goes to it), drained in two clicks."""
    worker_id = (
        control_plane_shell(
            "from controlplane.catalog.models import Model\n"
            "from controlplane.catalog.services import fleet_ensure, worker_register\n"
            "fleet = fleet_ensure(name='drain-demo', role='decode', model=Model.objects.get(name='diptych-tiny'),"
            " region='drain-demo', hardware_class='cpu')\n"
            "print(worker_register(fleet=fleet, name='drain-demo-0', address='127.0.0.1:9').public_id)\n"
        )
        .strip()
        .splitlines()[-1]
    )
    try:
        sign_in(page, STAFF_EMAIL, passwords[STAFF_EMAIL])
        row = page.locator("[data-table=workers] tr", has_text="drain-demo-0")
        expect(row).to_contain_text("ready")
        row.get_by_role("button", name="Drain").click()
        row.get_by_role("button", name="Confirm drain").click()
        expect(row).to_contain_text("draining")
        expect(row.get_by_role("button")).to_have_count(0)
        (worker,) = page.evaluate("fetch('/api/v1/workers?fleet=drain-demo').then(answer => answer.json())")["data"]
        assert (worker["id"], worker["state"]) == (worker_id, "draining") and worker["drain_requested_at"]
    finally:
        control_plane_shell(
            "from controlplane.catalog.models import Worker\n"
            f"Worker.objects.filter(public_id={worker_id!r}).update(state='dead')\n"
        )
