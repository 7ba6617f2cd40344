"""The Batch API end to end, through the official `openai` client pointed at the gateway: files and batches
on the control plane, lines run by the Celery jobs through the gateway at batch priority, each line billed
once at the batch tier, and a batch that survives its runner's death without losing or repeating a line."""

import asyncio
import json

import openai
import pytest
from playwright.sync_api import expect

import diptych

# The dashboard tests' browser fixtures, shared rather than copied.
from tests.e2e.test_dashboard import CHROMIUM, DIST, MEMBER_EMAIL, browser, page, passwords, sign_in  # noqa: F401
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"
CHAT = "/v1/chat/completions"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture(scope="module")
def jobs(live):
    """The control plane's Celery jobs, running batches through the split gateway: two lines of a batch at
    a time, and a runner's lease short enough that a batch whose runner died resumes within seconds."""
    live.stack.start_jobs(
        DIPTYCH_GATEWAY_URL=live.http_urls["split"],
        DIPTYCH_BATCH_MAX_CONCURRENT_LINES="2",
        DIPTYCH_BATCH_LEASE_SECONDS="3",
        DIPTYCH_BATCH_RESUME_SECONDS="1",
        DIPTYCH_BATCH_SLICE_SECONDS="5",
    )
    yield live
    live.stack.stop_process("jobs")


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_urls["split"], api_key=live.api_key, max_retries=0)


def chat_line(custom_id: str, content: str, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {**body, "temperature": 0}}


def run_batch(client: openai.OpenAI, lines: list[dict]):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("requests.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")


def wait_until_ended(client: openai.OpenAI, batch_id: str, seconds: float = 240.0):
    ended = wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in TERMINAL and b, seconds, 0.2)
    assert ended, f"batch {batch_id} did not end in {seconds} s: {client.batches.retrieve(batch_id)}"
    return ended


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(row) for row in client.files.content(file_id).text.splitlines()]


def answers(output: list[dict]) -> dict[str, tuple]:
    """custom_id -> (execution id, text, usage) of each answered line."""
    return {
        r["custom_id"]: (
            r["response"]["request_id"],
            r["response"]["body"]["choices"][0]["message"]["content"],
            r["response"]["body"]["usage"],
        )
        for r in output
    }


def runner_usage(control_plane_shell, batch_id: str) -> list[tuple[str, str, str]]:
    """(request id, phase, tier) of every ledger row the batch's runner key was billed for."""
    output = control_plane_shell(
        "import json\n"
        "from controlplane.batches.models import Batch\n"
        "from controlplane.metering.models import UsageEvent\n"
        f"batch = Batch.objects.get(public_id='{batch_id}')\n"
        "rows = UsageEvent.objects.filter(api_key=batch.runner_key).values_list('request_id', 'phase', 'tier')\n"
        "print(json.dumps(sorted(rows)))\n"
    )
    return [tuple(row) for row in json.loads(output.strip().splitlines()[-1])]


def test_the_openai_client_runs_a_batch_with_the_answers_of_interactive_requests(jobs, client, control_plane_shell):
    lines = [chat_line(f"q{i}", f"Question number {i}: why?") for i in range(4)]
    batch = run_batch(client, lines)
    assert batch.status == "validating" and batch.request_counts.total == 4
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "completed" and ended.error_file_id is None
    assert ended.request_counts.completed == 4 and ended.request_counts.failed == 0
    assert ended.in_progress_at and ended.finalizing_at and ended.completed_at
    assert batch.id in {b.id for b in client.batches.list(limit=100)}
    output = records(client, ended.output_file_id)
    assert [record["custom_id"] for record in output] == [line["custom_id"] for line in lines]
    for line, record in zip(lines, output, strict=True):
        assert record["response"]["status_code"] == 200 and record["error"] is None
        interactive = client.chat.completions.create(**line["body"])  # greedy: the same answer
        answer = record["response"]["body"]
        assert answer["choices"][0]["message"]["content"] == interactive.choices[0].message.content
        assert answer["usage"]["completion_tokens"] == interactive.usage.completion_tokens
        assert record["response"]["request_id"] == answer["id"]
    lines_usage = [record["response"]["body"]["usage"] for record in output]
    assert ended.usage.input_tokens == sum(usage["prompt_tokens"] for usage in lines_usage)
    assert ended.usage.output_tokens == sum(usage["completion_tokens"] for usage in lines_usage)
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in lines_usage)
    assert ended.usage.input_tokens_details.cached_tokens == cached
    assert ended.usage.total_tokens == ended.usage.input_tokens + ended.usage.output_tokens
    jobs.wait_until_usage_sent("split")
    billed = wait_for(lambda: len(u := runner_usage(control_plane_shell, batch.id)) == 8 and u, 30)
    assert {request_id for request_id, _, _ in billed} == {r["response"]["request_id"] for r in output}
    assert {tier for _, _, tier in billed} == {"batch"}


def test_a_batch_survives_its_runner_killed_mid_batch_without_losing_or_repeating_a_line(
    jobs, client, control_plane_shell
):
    lines = [chat_line(f"line-{i}", f"Tell me about number {i}", max_tokens=24) for i in range(16)]
    batch = run_batch(client, lines)
    started = wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 120, 0.05)
    assert started, "the batch did not start"
    jobs.stack.kill_process("jobs")  # SIGKILL: lines on their way stay unrecorded
    at_kill = client.batches.retrieve(batch.id)
    assert at_kill.request_counts.completed < 16, "the batch ended before its runner could be killed"
    jobs.stack.restart_process("jobs")
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "completed"
    assert ended.request_counts.completed == 16 and ended.request_counts.failed == 0
    output = records(client, ended.output_file_id)
    assert sorted(record["custom_id"] for record in output) == sorted(line["custom_id"] for line in lines)
    jobs.wait_until_usage_sent("split")
    request_ids = {record["response"]["request_id"] for record in output}
    billed = wait_for(lambda: len(u := runner_usage(control_plane_shell, batch.id)) >= 32 and u, 30)
    assert sorted(billed) == sorted((r, phase, "batch") for r in request_ids for phase in ("prefill", "decode"))


def test_a_line_sent_again_gets_its_stored_answer_and_is_not_billed_again(jobs, client, control_plane_shell):
    batch = run_batch(client, [chat_line("a", "first"), chat_line("b", "second")])
    ended = wait_until_ended(client, batch.id)
    first = answers(records(client, ended.output_file_id))
    jobs.wait_until_usage_sent("split")
    billed = wait_for(lambda: len(u := runner_usage(control_plane_shell, batch.id)) == 4 and u, 30)
    # As if the runner had died after sending both lines and before recording either answer: the batch
    # has not ended, so neither has its runner key.
    control_plane_shell(
        "from django.conf import settings\n"
        "from controlplane.batches.models import Batch, BatchLine\n"
        "from controlplane.batches.runner import run_slice\n"
        "from controlplane.tenancy.models import ApiKey\n"
        f"settings.DIPTYCH_GATEWAY_URL = '{jobs.http_urls['split']}'\n"
        f"batch = Batch.objects.get(public_id='{batch.id}')\n"
        "BatchLine.objects.filter(batch=batch).update(state='pending', response=None, request_id='')\n"
        "Batch.objects.filter(id=batch.id).update(status='in_progress', output_file=None)\n"
        "ApiKey.objects.filter(pk=batch.runner_key_id).update(revoked_at=None)\n"
        "assert run_slice(batch.id).ended\n"
    )
    again = client.batches.retrieve(batch.id)
    assert again.status == "completed" and again.output_file_id != ended.output_file_id
    assert answers(records(client, again.output_file_id)) == first  # the same executions' answers
    jobs.wait_until_usage_sent("split")
    assert runner_usage(control_plane_shell, batch.id) == billed


def test_cancel_stops_a_batch_and_accounts_for_every_line_once(jobs, client):
    lines = [chat_line(f"c{i}", f"Cancel me {i}", max_tokens=24) for i in range(20)]
    batch = run_batch(client, lines)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    counts = ended.request_counts
    assert counts.completed + counts.failed == 20 and counts.failed > 0
    done = records(client, ended.output_file_id)
    not_run = records(client, ended.error_file_id)
    assert len(done) == counts.completed
    assert {r["error"]["code"] for r in not_run} == {"batch_cancelled"}
    assert sorted(r["custom_id"] for r in done + not_run) == sorted(line["custom_id"] for line in lines)


def test_cancelling_while_the_runner_is_dead_reports_every_billed_line_with_its_answer(
    jobs, client, control_plane_shell
):
    """Lines on their way when the runner is killed run to their end on the gateway and are billed: the
    runner started again must report them with their answers, and bill nothing for the lines it never sent."""
    lines = [chat_line(f"k{i}", f"Keep going about {i}", max_tokens=96) for i in range(6)]
    batch = run_batch(client, lines)
    on_their_way = wait_for(lambda: split_workers_busy(jobs), 120, 0.02)
    assert on_their_way, "no line of the batch reached the workers"
    client.batches.cancel(batch.id)
    jobs.stack.kill_process("jobs")
    jobs.stack.restart_process("jobs")
    ended = wait_until_ended(client, batch.id)
    assert ended.status == "cancelled"
    output, errors = records(client, ended.output_file_id), records(client, ended.error_file_id)
    assert output, "the lines that were running when the runner died are missing from the output file"
    assert {r["error"]["code"] for r in errors} <= {"batch_cancelled"}
    assert sorted(r["custom_id"] for r in output + errors) == sorted(line["custom_id"] for line in lines)
    assert wait_for(lambda: not split_workers_busy(jobs), 60, 0.1), "the workers kept running batch lines"
    jobs.wait_until_usage_sent("split")
    reported = {r["response"]["request_id"] for r in output}
    billed = runner_usage(control_plane_shell, batch.id)
    assert sorted(billed) == sorted((r, phase, "batch") for r in reported for phase in ("prefill", "decode"))


def test_a_line_the_gateway_refuses_fails_alone_and_its_body_stays_out_of_the_log(jobs, client, control_plane_shell):
    """A line no encoder can send as UTF-8 (a lone surrogate, in a batch created before upload refused
    such lines) goes to the gateway escaped and is refused there: it fails, the others run, and the jobs
    log never shows a request body."""
    jobs.stack.stop_process("jobs")  # so that the line is changed before any runner sees it
    marker = "secret-prompt-7f3a"
    batch = run_batch(client, [chat_line("ok-1", "fine"), chat_line("bad", marker), chat_line("ok-2", "fine too")])
    control_plane_shell(
        "from controlplane.batches.models import BatchLine\n"
        f"line = BatchLine.objects.get(batch__public_id='{batch.id}', custom_id='bad')\n"
        f"line.body['messages'][0]['content'] = '{marker} \\ud800'\n"
        "line.save(update_fields=['body'])\n"
    )
    jobs.stack.restart_process("jobs")
    ended = wait_until_ended(client, batch.id, seconds=120)
    assert ended.status == "completed" and ended.request_counts.completed == 2
    assert [r["custom_id"] for r in records(client, ended.output_file_id)] == ["ok-1", "ok-2"]
    (refused,) = records(client, ended.error_file_id)
    assert refused["custom_id"] == "bad" and refused["response"]["status_code"] == 400
    assert "lone UTF-16 surrogate" in refused["response"]["body"]["error"]["message"]
    assert marker not in jobs.stack.log_path("jobs").read_text(errors="replace")


def test_a_batch_of_an_organization_over_its_spend_limit_fails_its_lines_and_bills_nothing(
    jobs, client, live, control_plane_shell
):
    with live.rest() as rest:
        assert rest.put("/spend-limit", json={"limit_micros": 0}).status_code == 200
    try:
        batch = run_batch(client, [chat_line("s1", "over"), chat_line("s2", "the limit")])
        ended = wait_until_ended(client, batch.id, seconds=60)
    finally:
        with live.rest() as rest:
            assert rest.put("/spend-limit", json={"limit_micros": None}).status_code == 200
    assert ended.status == "completed" and ended.request_counts.failed == 2 and ended.output_file_id is None
    for record in records(client, ended.error_file_id):
        assert record["response"]["status_code"] == 429
        assert record["response"]["body"]["error"]["code"] == "insufficient_quota"
    jobs.wait_until_usage_sent("split")
    assert runner_usage(control_plane_shell, batch.id) == []
    # The demo key may spend again once the gateway's key cache (5 s) has forgotten the limit.
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2}
    assert wait_for(lambda: spends_again(client, ask), 15, 0.5), "still refused after the limit was lifted"


def spends_again(client: openai.OpenAI, ask: dict) -> bool:
    try:
        client.chat.completions.create(**ask)
    except openai.RateLimitError:
        return False
    return True


def split_workers_busy(live) -> bool:
    """Whether the split gateway's workers hold a sequence (running or queued)."""
    loads = [live.worker_load(name) for name in ("prefill-0", "decode-0")]
    return any(load.active_sequences or load.queue_depth for load in loads)


def test_bad_input_and_another_organization_are_refused_through_the_gateway(jobs, client, live, other_organization):
    with pytest.raises(openai.BadRequestError, match="line 2: custom_id 'x' repeats line 1"):
        client.files.create(file=("bad.jsonl", (json.dumps(chat_line("x", "a")) + "\n") * 2), purpose="batch")
    uploaded = client.files.create(file=("ok.jsonl", json.dumps(chat_line("x", "a")) + "\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1: url is '/v1/chat/completions'"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    other = openai.OpenAI(base_url=live.http_urls["split"], api_key=other_organization["api_key"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert batch.id not in {b.id for b in other.batches.list()}
    nobody = openai.OpenAI(base_url=live.http_urls["split"], api_key="dip_not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nobody.batches.list()
    assert wait_until_ended(client, batch.id).status == "completed"


def test_batch_usage_is_rated_at_the_batch_price_and_saying_priority_batch_is_not_enough(
    jobs, client, live, control_plane_shell
):
    ordinary = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "cheap?"}], max_tokens=4, extra_body={"priority": "batch"}
    )
    ended = wait_until_ended(client, run_batch(client, [chat_line("p", "price me")]).id)
    batched = records(client, ended.output_file_id)[0]["response"]["request_id"]
    jobs.wait_until_usage_sent("split")
    with live.rest() as rest:
        tiers = {
            execution: wait_for(
                lambda e=execution: (
                    len(rows := rest.get("/usage-events", params={"request_id": e}).json()["data"]) == 2 and rows
                ),
                30,
            )
            for execution in (ordinary.id, batched)
        }
        assert {row["tier"] for row in tiers[ordinary.id]} == {"standard"}
        assert {row["tier"] for row in tiers[batched]} == {"batch"}
        summary = rest.get("/usage/summary").json()["data"]
    assert {row["tier"] for row in summary} == {"standard", "batch"}
    output = control_plane_shell(
        "import json\n"
        "from dataclasses import asdict\n"
        "from django.utils import timezone\n"
        "from controlplane.billing.periods import period_start_of\n"
        "from controlplane.billing.services import invoice_lines_from_ledger\n"
        "from controlplane.catalog.selectors import price_book\n"
        "from controlplane.tenancy.models import Organization\n"
        f"organization = Organization.objects.get(public_id='{live.credentials.organization_id}')\n"
        "lines = invoice_lines_from_ledger(\n"
        "    organization=organization, period_start=period_start_of(timezone.now()), book=price_book())\n"
        "print(json.dumps([asdict(line) for line in lines]))\n"
    )
    lines = json.loads(output.strip().splitlines()[-1])
    price = {(line["phase"], line["tier"]): line["unit_price_micros_per_million"] for line in lines}
    assert ("decode", "batch") in price and ("prefill", "batch") in price
    for phase, tier in price:
        if tier == "batch":
            assert price[(phase, "batch")] * 2 == price[(phase, "standard")]


def test_the_sdk_uploads_runs_lists_and_reads_a_batch(jobs, live):
    client = diptych.Client(
        api_key=live.api_key, base_url=live.gateways["split"], admin_url=live.stack.control_plane_url, max_retries=0
    )
    with pytest.raises(diptych.BadRequestError, match="line 1: not valid JSON"):
        client.files.create(file=("bad.jsonl", b"{oops\n"))
    content = "".join(json.dumps(chat_line(f"s{i}", f"sdk {i}")) + "\n" for i in range(2)).encode()
    uploaded = client.files.create(file=("sdk.jsonl", content))
    assert uploaded.purpose == "batch" and uploaded.bytes == len(content)
    assert client.files.content(uploaded.id) == content
    batch = client.batches.create(input_file_id=uploaded.id, metadata={"from": "sdk"})
    ended = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in TERMINAL and b, 240, 0.2)
    assert ended and ended.status == "completed" and ended.metadata == {"from": "sdk"}
    assert ended.request_counts == diptych.BatchRequestCounts(total=2, completed=2, failed=0)
    output = [json.loads(row) for row in client.files.content(ended.output_file_id).splitlines()]
    assert [row["custom_id"] for row in output] == ["s0", "s1"]
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [batch.id] and first.has_more and first.last_id == batch.id
    assert batch.id not in {b.id for b in client.batches.list(limit=5, after=first.last_id).data}

    async def retrieve_async() -> diptych.Batch:
        async with diptych.AsyncClient(
            api_key=live.api_key, base_url=live.gateways["split"], admin_url=live.stack.control_plane_url
        ) as async_client:
            return await async_client.batches.retrieve(batch.id)

    assert asyncio.run(retrieve_async()) == ended


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")
@pytest.mark.skipif(not DIST.exists(), reason="needs the dashboard bundle: make install")
def test_the_dashboard_lists_batches_with_their_files_and_cancels_one(jobs, client, page, passwords):  # noqa: F811
    done = wait_until_ended(client, run_batch(client, [chat_line("d", "dashboard")]).id)
    jobs.stack.stop_process("jobs")  # the next batch waits, so that it is still running when it is cancelled
    waiting = run_batch(client, [chat_line("w", "waits")])
    sign_in(page, MEMBER_EMAIL, passwords[MEMBER_EMAIL])
    finished = page.locator("[data-table=batches] tr", has_text=done.id)
    expect(finished.locator("[data-status]")).to_have_text("completed")
    expect(finished).to_contain_text("1 / 1")
    output = finished.get_by_role("link", name="output")
    assert page.request.get(output.get_attribute("href")).json()["custom_id"] == "d"
    page.get_by_role("button", name=f"Cancel {waiting.id}").click()
    row = page.locator("[data-table=batches] tr", has_text=waiting.id)
    expect(row.locator("[data-status]")).to_have_text("cancelling")
    jobs.stack.restart_process("jobs")
    assert wait_until_ended(client, waiting.id).status == "cancelled"


def test_an_idempotency_key_sent_through_the_gateway_creates_one_batch(jobs, client):
    content = (json.dumps(chat_line("only", "Once.")) + "\n").encode()
    uploaded = client.files.create(file=("requests.jsonl", content), purpose="batch")
    create = client.batches.with_raw_response.create
    params = {"input_file_id": uploaded.id, "endpoint": CHAT, "completion_window": "24h"}
    first = create(**params, extra_headers={"Idempotency-Key": f"create-{uploaded.id}"})
    again = create(**params, extra_headers={"Idempotency-Key": f"create-{uploaded.id}"})
    assert again.parse().id == first.parse().id
    assert again.headers.get("Idempotent-Replayed") == "true" and "Idempotent-Replayed" not in first.headers
    wait_until_ended(client, first.parse().id)
