"""The Batch API on the control plane: files (each bad line refused by number), batches (create, retrieve,
list, cancel, expire), one organization never reaching another's, and the runner's key.

Running lines needs a gateway and workers: tests/e2e/test_batch_api.py runs batches end to end. Here a
batch is cancelled or expired before any line is sent, which the runner ends without a gateway.
"""

import importlib
import json
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from controlplane.batches.models import Batch, BatchLine, File, LineState
from controlplane.batches.run_services import (
    LineAnswer,
    line_answered,
    line_postponed,
    line_sending,
    runner_key_secret,
)
from controlplane.batches.runner import run_slice
from controlplane.tenancy.project_services import project_create
from controlplane.tenancy.services import api_key_create, member_add
from tests.platform.conftest import bearer_client

FILES = "/api/v1/files"
BATCHES = "/api/v1/batches"
CHAT = "/v1/chat/completions"


def line(custom_id: str = "r1", url: str = CHAT, **overrides) -> dict:
    body = {"model": "diptych-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **overrides}


def jsonl(*rows) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


def upload(client, content: bytes, purpose: str = "batch"):
    return client.post(
        FILES, {"file": SimpleUploadedFile("input.jsonl", content), "purpose": purpose}, format="multipart"
    )


@pytest.fixture
def input_file(client_a, tiny_model) -> dict:
    response = upload(client_a, jsonl(line("a"), line("b"), line("c")))
    assert response.status_code == 200, response.data
    return response.data


def create_batch(client, file_id: str, **overrides):
    return client.post(
        BATCHES, {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **overrides}, format="json"
    )


def test_upload_returns_the_file_and_its_content(client_a, input_file):
    assert input_file["object"] == "file" and input_file["purpose"] == "batch"
    assert input_file["bytes"] == len(jsonl(line("a"), line("b"), line("c")))
    content = client_a.get(f"{FILES}/{input_file['id']}/content")
    assert content.status_code == 200
    assert [json.loads(row)["custom_id"] for row in content.content.splitlines()] == ["a", "b", "c"]


def surrogate_prompt() -> bytes:
    row = json.dumps(line("a"))  # ASCII: the escape below stays an escape
    return row.replace('"Hi"', '"\\ud800"').encode() + b"\n"


def nested(depth: int) -> dict:
    body: dict = {"model": "diptych-tiny"}
    for _ in range(depth):
        body = {"x": body}
    return body


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (jsonl(line("a"), b"{not json"), "line 2: not valid JSON"),
        (jsonl(line("a"), line("b"), line("a")), "line 3: custom_id 'a' repeats line 1"),
        (jsonl(line("a", method="GET")), "line 1: method is 'GET'"),
        (jsonl(line("a"), line("b", url="/v1/completions")), "line 2: url is '/v1/completions' but line 1"),
        (jsonl(line("a", url="/v1/embeddings")), "line 1: url is '/v1/embeddings'"),
        (jsonl(line("a", body=[1, 2])), "line 1: body must be a JSON object"),
        (jsonl(line("a"), line("b", body={"model": "diptych-tiny", "stream": True})), "line 2: body.stream"),
        (jsonl(line("")), "line 1: custom_id must be a non-empty string"),
        (jsonl(line("a"), [1]), "line 2: must be a JSON object"),
        (jsonl(line("a", extra=1)), "line 1: unknown field 'extra'"),
        (b"\n\n", "the file holds no request"),
        (b"\xff\xfe", "not UTF-8"),
        (jsonl(line("a"), b'{"custom_id": "\\ud800", "method": "POST"}'), "line 2: Invalid text at 'custom_id'"),
        (surrogate_prompt(), "line 1: Invalid text at 'body.messages[0].content': \\ud800 is a lone UTF-16"),
        (
            jsonl(line("a", body={"model": "diptych-tiny", "\udfff": 1})),
            "line 1: Invalid text at 'body.\\udfff (a key)'",
        ),
        (jsonl(line("a"), b"[" * 10_000 + b"]" * 10_000), "line 2: JSON nested too deeply"),
        (jsonl(line("a", body=nested(40))), "line 1: JSON nested too deeply"),
        (
            jsonl(line("a", body={"model": "diptych-tiny", "temperature": "NaN"}), b'{"custom_id": NaN}'),
            "line 2: not valid JSON (NaN",
        ),
    ],
)
def test_bad_input_files_are_refused_naming_the_line(client_a, content, expected):
    response = upload(client_a, content)
    assert response.status_code == 400
    assert expected in response.data["error"]["message"]
    assert not File.objects.exists()


def test_lines_end_at_newlines_alone_and_strings_may_hold_any_line_separator(client_a, tiny_model):
    """JSON Lines: a line ends at "\\n" (a "\\r" before it is JSON whitespace); U+2028, U+2029, U+0085 and
    the other characters str.splitlines splits at are text inside a string."""
    separators = "\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"
    rows = [line("a"), line("b"), line("c")]
    rows[1]["body"]["messages"][0]["content"] = f"one{separators}two"
    content = "\r\n".join(json.dumps(row, ensure_ascii=False) for row in rows).encode()
    assert "\u2028".encode() in content
    uploaded = upload(client_a, content)
    assert uploaded.status_code == 200, uploaded.data
    batch_id = create_batch(client_a, uploaded.data["id"]).data["id"]
    lines = BatchLine.objects.filter(batch__public_id=batch_id).order_by("line_number")
    assert [(n.line_number, n.custom_id) for n in lines] == [(1, "a"), (2, "b"), (3, "c")]
    assert lines[1].body["messages"][0]["content"] == f"one{separators}two"


def test_a_file_refused_now_but_stored_before_is_refused_at_create(client_a, tiny_model, org_a):
    """A file stored before its lines were checked this closely: the batch is refused, not a 500."""
    stored = File.objects.create(
        organization=org_a,
        purpose="batch",
        filename="old.jsonl",
        content=jsonl(
            line("a"), b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
        ),
        bytes=1,
        line_count=2,
        endpoint=CHAT,
    )
    response = create_batch(client_a, stored.public_id)
    assert response.status_code == 400, response.data
    assert "line 2: Invalid text at 'custom_id'" in response.data["error"]["message"]
    assert not Batch.objects.exists()


def test_files_are_bounded_in_bytes_and_lines(client_a, settings):
    settings.DIPTYCH_BATCH_FILE_MAX_LINES = 2
    response = upload(client_a, jsonl(line("a"), line("b"), line("c")))
    assert response.status_code == 400 and "at most 2" in response.data["error"]["message"]
    settings.DIPTYCH_BATCH_FILE_MAX_BYTES = 100
    response = upload(client_a, jsonl(line("a")))
    assert response.status_code == 400 and "at most 100 bytes" in response.data["error"]["message"]
    assert not File.objects.exists()


def test_upload_refuses_other_purposes(client_a):
    response = upload(client_a, jsonl(line("a")), purpose="fine-tune")
    assert response.status_code == 400 and "purpose" in response.data["error"]["message"]


def test_create_returns_a_validating_batch_with_its_lines(client_a, input_file):
    response = create_batch(client_a, input_file["id"], metadata={"job": "nightly"})
    assert response.status_code == 200, response.data
    batch = response.data
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["endpoint"] == CHAT and batch["completion_window"] == "24h"
    assert batch["input_file_id"] == input_file["id"] and batch["metadata"] == {"job": "nightly"}
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert client_a.get(f"{BATCHES}/{batch['id']}").data == batch


def test_expires_at_is_exactly_the_window_after_created_at_on_a_clock_that_moves(client_a, input_file, monkeypatch):
    """Both timestamps come from one clock reading: a clock that moves between two readings (here 0.7 s a
    reading, so every pair straddles a second) must not put expires_at a second off created_at."""
    start, readings = timezone.now(), iter(range(10_000))
    monkeypatch.setattr(timezone, "now", lambda: start + timedelta(seconds=0.7 * next(readings)))
    batch = create_batch(client_a, input_file["id"]).data
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    stored = Batch.objects.get(public_id=batch["id"])
    assert stored.expires_at - stored.created_at == timedelta(hours=24)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"endpoint": "/v1/completions"}, "line 1: url is '/v1/chat/completions' but the batch's endpoint"),
        ({"endpoint": "/v1/embeddings"}, "endpoint is '/v1/embeddings'"),
        ({"completion_window": "48h"}, "completion_window is '48h'; only '24h'"),
        ({"metadata": {"k": 1}}, "metadata values must be strings"),
    ],
)
def test_create_refuses_bad_parameters(client_a, input_file, overrides, expected):
    response = create_batch(client_a, input_file["id"], **overrides)
    assert response.status_code == 400
    assert expected in response.data["error"]["message"]
    assert not Batch.objects.exists()


def test_create_refuses_a_line_naming_an_unknown_model(client_a, tiny_model):
    file_id = upload(client_a, jsonl(line("a"), line("b", body={"model": "nope"}))).data["id"]
    response = create_batch(client_a, file_id)
    assert response.status_code == 400
    assert "line 2: body.model is 'nope'" in response.data["error"]["message"]
    assert not Batch.objects.exists()


def test_list_pages_newest_first_with_a_cursor(client_a, input_file):
    ids = [create_batch(client_a, input_file["id"]).data["id"] for _ in range(3)]
    first = client_a.get(BATCHES, {"limit": 2}).data
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    assert first["object"] == "list" and first["last_id"] == ids[1]
    second = client_a.get(BATCHES, {"limit": 2, "after": first["last_id"]}).data
    assert [b["id"] for b in second["data"]] == [ids[0]] and second["has_more"] is False
    unknown = client_a.get(BATCHES, {"after": "batch_unknown"})
    assert unknown.status_code == 404 and unknown.data["error"]["fields"] == {"after": ["Unknown id."]}
    assert "no object with id 'batch_unknown'" in unknown.data["error"]["message"]
    assert client_a.get(BATCHES, {"limit": 0}).status_code == 400


def test_an_organization_never_reaches_another_ones_files_and_batches(client_a, client_b, input_file, tiny_model):
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    file_id = input_file["id"]
    assert client_b.get(FILES).data["data"] == []
    assert client_b.get(BATCHES).data["data"] == []
    for response in (
        client_b.get(f"{FILES}/{file_id}"),
        client_b.get(f"{FILES}/{file_id}/content"),
        client_b.delete(f"{FILES}/{file_id}"),
        create_batch(client_b, file_id),
        client_b.get(f"{BATCHES}/{batch_id}"),
        client_b.post(f"{BATCHES}/{batch_id}/cancel"),
    ):
        assert response.status_code == 404, response.content
    assert File.objects.filter(public_id=file_id).exists()
    assert Batch.objects.get(public_id=batch_id).status == "validating"
    assert client_a.get(f"{FILES}/{file_id}").status_code == 200


def test_an_inference_key_may_use_the_batch_api_and_a_billing_viewer_may_not(org_a, tiny_model):
    inference = bearer_client(api_key_create(organization=org_a, name="inference", scopes=["inference"]).key)
    assert upload(inference, jsonl(line("a"))).status_code == 200
    assert inference.get(BATCHES).status_code == 200
    viewer = member_add(organization=org_a, email="viewer@acme.test", role="billing_viewer", password="pw-12345678")
    from rest_framework.test import APIClient

    session = APIClient()
    session.force_login(viewer.user)
    response = session.get(BATCHES)
    assert response.status_code == 403 and "batches:read" in response.data["error"]["message"]


def test_cancel_before_any_line_ran_ends_with_every_line_in_the_error_file(client_a, input_file):
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    cancelled = client_a.post(f"{BATCHES}/{batch_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.data["status"] == "cancelling"
    assert cancelled.data["cancelling_at"] is not None
    assert run_slice(Batch.objects.get(public_id=batch_id).id).ended
    batch = client_a.get(f"{BATCHES}/{batch_id}").data
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert batch["output_file_id"] is None
    errors = [json.loads(row) for row in client_a.get(f"{FILES}/{batch['error_file_id']}/content").content.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(c, "batch_cancelled") for c in "abc"]
    again = client_a.post(f"{BATCHES}/{batch_id}/cancel")  # cancelling a cancelled batch changes nothing
    assert again.status_code == 200 and again.data["status"] == "cancelled"


def test_a_cancelled_batch_reports_a_line_it_sent_with_its_answer_once_it_has_it(client_a, input_file):
    """A line sent before the cancel may have run (and been billed): the batch waits for its answer (here
    the gateway said the line still runs, 409) instead of reporting it as never run."""
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    Batch.objects.filter(public_id=batch_id).update(status="in_progress")
    sent = BatchLine.objects.get(batch__public_id=batch_id, custom_id="a")
    line_sending(line=sent)
    line_postponed(line=sent, not_before=timezone.now() + timedelta(hours=1), counted=False, may_have_run=True)
    refused = BatchLine.objects.get(batch__public_id=batch_id, custom_id="b")
    line_sending(line=refused)  # ... and refused (429): it did not run
    line_postponed(line=refused, not_before=timezone.now() + timedelta(hours=1), counted=False, may_have_run=False)
    assert client_a.post(f"{BATCHES}/{batch_id}/cancel").data["status"] == "cancelling"
    batch = Batch.objects.get(public_id=batch_id)
    assert run_slice(batch.id).ended is False
    assert client_a.get(f"{BATCHES}/{batch_id}").data["status"] == "cancelling"
    answer = {"id": "exec_a", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ran"}}]}
    line_answered(line=sent, answer=LineAnswer(status_code=200, body=answer, request_id="exec_a"))
    assert run_slice(batch.id).ended
    ended = client_a.get(f"{BATCHES}/{batch_id}").data
    assert ended["status"] == "cancelled"
    (output,) = [json.loads(r) for r in client_a.get(f"{FILES}/{ended['output_file_id']}/content").content.splitlines()]
    assert output["custom_id"] == "a" and output["response"]["request_id"] == "exec_a"
    errors = [json.loads(r) for r in client_a.get(f"{FILES}/{ended['error_file_id']}/content").content.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("b", "batch_cancelled"),
        ("c", "batch_cancelled"),
    ]


def test_a_batch_past_its_window_expires_without_running_its_lines(client_a, input_file):
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    Batch.objects.filter(public_id=batch_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run_slice(Batch.objects.get(public_id=batch_id).id).ended
    batch = client_a.get(f"{BATCHES}/{batch_id}").data
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert set(BatchLine.objects.values_list("state", flat=True)) == {LineState.NOT_RUN}
    errors = client_a.get(f"{FILES}/{batch['error_file_id']}/content").content.splitlines()
    assert [json.loads(row)["error"]["code"] for row in errors] == ["batch_expired"] * 3
    refused = client_a.post(f"{BATCHES}/{batch_id}/cancel")
    assert refused.status_code == 400 and "only a validating or in-progress batch" in refused.data["error"]["message"]


def test_a_runner_holds_a_batch_alone_until_its_lease_ends(client_a, input_file):
    from controlplane.batches.run_services import batch_lease_claim

    batch = Batch.objects.get(public_id=create_batch(client_a, input_file["id"]).data["id"])
    now = timezone.now()
    assert batch_lease_claim(batch_id=batch.id, holder="one", now=now) is not None
    assert batch_lease_claim(batch_id=batch.id, holder="two", now=now) is None
    assert batch_lease_claim(batch_id=batch.id, holder="one", now=now) is not None
    assert run_slice(batch.id).ended is False  # held by "one": this runner leaves it alone
    later = now + timedelta(hours=1)
    assert batch_lease_claim(batch_id=batch.id, holder="two", now=later) is not None


def test_the_runner_key_is_a_batch_key_and_others_are_standard(internal_client, client_a, input_file, key_a):
    batch = Batch.objects.get(public_id=create_batch(client_a, input_file["id"]).data["id"])
    verify = "/api/v1/internal/api-keys/verify"
    runner = internal_client.post(verify, {"api_key": runner_key_secret(batch.public_id)})
    assert runner.status_code == 200
    assert runner.data["kind"] == "batch" and runner.data["api_key_id"] == batch.runner_key.public_id
    assert runner.data["scopes"] == ["inference"] and runner.data["batch_id"] == batch.public_id
    standard = internal_client.post(verify, {"api_key": key_a.key}).data
    assert standard["kind"] == "standard" and standard["batch_id"] is None


@pytest.mark.parametrize("end", ["completed", "cancelled", "expired"])
def test_a_runner_key_is_revoked_when_its_batch_ends(internal_client, client_a, input_file, end):
    batch = Batch.objects.get(public_id=create_batch(client_a, input_file["id"]).data["id"])
    Batch.objects.filter(id=batch.id).update(status="in_progress")
    if end == "completed":
        for line in BatchLine.objects.filter(batch=batch):
            line_answered(line=line, answer=LineAnswer(status_code=400, body={"error": {"message": "no"}}))
    elif end == "cancelled":
        client_a.post(f"{BATCHES}/{batch.public_id}/cancel")
    else:
        Batch.objects.filter(id=batch.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    verify = "/api/v1/internal/api-keys/verify"
    assert internal_client.post(verify, {"api_key": runner_key_secret(batch.public_id)}).status_code == 200
    assert run_slice(batch.id).ended
    assert client_a.get(f"{BATCHES}/{batch.public_id}").data["status"] == end
    refused = internal_client.post(verify, {"api_key": runner_key_secret(batch.public_id)})
    assert refused.status_code == 401 and refused.data["error"]["type"] == "api_key_revoked"


def test_a_runner_key_reaches_no_file_and_no_batch(client_a, input_file):
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    runner = bearer_client(runner_key_secret(batch_id))
    calls = [
        runner.get(FILES),
        runner.get(f"{FILES}/{input_file['id']}/content"),
        runner.get(BATCHES),
        runner.get(f"{BATCHES}/{batch_id}"),
        runner.post(f"{BATCHES}/{batch_id}/cancel"),
        upload(runner, jsonl(line("x"))),
    ]
    for response in calls:
        assert response.status_code == 403, response.data
        assert "runner key" in response.data["error"]["message"]
    assert client_a.get(f"{BATCHES}/{batch_id}").data["status"] == "validating"
    assert File.objects.count() == 1


def test_deleted_input_file_keeps_its_batch_running(client_a, input_file):
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    deleted = client_a.delete(f"{FILES}/{input_file['id']}")
    assert deleted.status_code == 200 and deleted.data == {"id": input_file["id"], "object": "file", "deleted": True}
    assert client_a.get(f"{FILES}/{input_file['id']}").status_code == 404
    assert client_a.get(f"{BATCHES}/{batch_id}").data["request_counts"]["total"] == 3


def test_batch_usage_is_billed_at_the_batch_price_on_lines_of_its_own(
    internal_client, make_usage_event, key_a, client_a, tiny_model
):
    from controlplane.billing.services import billing_periods_close, usage_rollup
    from controlplane.catalog.services import price_set
    from tests.platform.test_platform_billing import LONG_AGO, TINY_PRICES, ingest, last_month_at

    for phase, micros in TINY_PRICES.items():
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    price_set(model=tiny_model, phase="decode", tier="batch", micros_per_million=200_000, effective_from=LONG_AGO)
    at = last_month_at(10)
    decode = {"tokens": 1_000_000, "cached_tokens": 0}
    ingest(internal_client, make_usage_event, key_a, "req-standard", "decode", at, **decode)
    ingest(internal_client, make_usage_event, key_a, "req-batch", "decode", at, tier="batch", **decode)
    ingest(internal_client, make_usage_event, key_a, "req-old", "prefill", at, tokens=10, cached_tokens=0)  # no tier
    ingest(internal_client, make_usage_event, key_a, "req-batch", "prefill", at, tier="batch", **decode)
    batch_events = client_a.get("/api/v1/usage-events", {"tier": "batch"}).data["data"]
    assert {(e["request_id"], e["tier"]) for e in batch_events} == {("req-batch", "batch")}
    assert client_a.get("/api/v1/usage-events", {"request_id": "req-old"}).data["data"][0]["tier"] == "standard"
    usage_rollup()
    invoice = client_a.get(f"/api/v1/invoices/{billing_periods_close()[0].public_id}").data
    lines = {(line["phase"], line["tier"]): line for line in invoice["lines"]}
    assert lines[("decode", "batch")]["unit_price_micros_per_million"] == 200_000
    assert lines[("decode", "batch")]["amount_micros"] == 200_000
    assert lines[("decode", "standard")]["amount_micros"] == 400_000
    # No batch price for prefill: batch prefill is rated at the standard price, still on a batch line.
    assert lines[("prefill", "batch")]["unit_price_micros_per_million"] == TINY_PRICES["prefill"]
    assert lines[("prefill", "standard")]["tokens"] == 10


def test_an_unknown_tier_is_refused_at_ingest(internal_client, make_usage_event, key_a):
    event = make_usage_event(key_a, "req-1", "decode", tier="free")
    response = internal_client.post("/api/v1/internal/usage-events", {"events": [event]})
    assert response.status_code == 400 and "tier" in json.dumps(response.data)


def test_lines_and_answers_holding_any_character_are_kept_whole(client_a, tiny_model):
    """A client's strings and generated text may hold NUL and other control characters, which PostgreSQL's
    jsonb refuses: a line's body and its answer are kept all the same, into the output file."""
    text = "a\x00b\x1fc"
    row = line("nul")
    row["body"]["messages"][0]["content"] = text
    uploaded = upload(client_a, jsonl(row))
    assert uploaded.status_code == 200, uploaded.data
    batch_id = create_batch(client_a, uploaded.data["id"]).data["id"]
    batch_line = BatchLine.objects.get(batch__public_id=batch_id)
    assert batch_line.body["messages"][0]["content"] == text
    answer = {"id": "exec_1", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    line_answered(line=batch_line, answer=LineAnswer(status_code=200, body=answer, request_id="exec_1"))
    batch_line.refresh_from_db()
    assert batch_line.response == answer and batch_line.state == LineState.SUCCEEDED
    Batch.objects.filter(public_id=batch_id).update(status="in_progress")
    assert run_slice(Batch.objects.get(public_id=batch_id).id).ended
    output_id = client_a.get(f"{BATCHES}/{batch_id}").data["output_file_id"]
    (record,) = [json.loads(r) for r in client_a.get(f"{FILES}/{output_id}/content").content.splitlines()]
    assert record["response"]["body"] == answer


def answered(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    return {"id": "exec_1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}], "usage": usage}


def test_a_batch_s_usage_sums_the_usage_of_its_answered_lines(client_a, input_file):
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    created = client_a.get(f"{BATCHES}/{batch_id}").data["usage"]
    assert created["total_tokens"] == 0 and created["input_tokens_details"] == {"cached_tokens": 0}
    Batch.objects.filter(public_id=batch_id).update(status="in_progress")
    lines = {line.custom_id: line for line in BatchLine.objects.filter(batch__public_id=batch_id)}
    line_answered(line=lines["a"], answer=LineAnswer(status_code=200, body=answered(10, 4, 3), request_id="exec_a"))
    line_answered(line=lines["b"], answer=LineAnswer(status_code=200, body=answered(12, 0, 5), request_id="exec_b"))
    refused = {"error": {"message": "no"}, "usage": {"prompt_tokens": 99}}  # not a succeeded line's: not summed
    line_answered(line=lines["c"], answer=LineAnswer(status_code=400, body=refused))
    assert run_slice(Batch.objects.get(public_id=batch_id).id).ended
    completed = client_a.get(f"{BATCHES}/{batch_id}").data
    assert completed["status"] == "completed"
    assert completed["usage"] == {
        "input_tokens": 22,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 8,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 30,
    }
    assert client_a.get(BATCHES).data["data"][0]["usage"] == completed["usage"]


def test_lines_answered_before_their_usage_was_kept_get_it_from_their_answers(client_a, input_file):
    migration = importlib.import_module("controlplane.batches.migrations.0004_line_usage")
    batch_id = create_batch(client_a, input_file["id"]).data["id"]
    lines = BatchLine.objects.filter(batch__public_id=batch_id).order_by("line_number")
    first = lines.get(custom_id="a")
    first.state, first.status_code, first.response = LineState.SUCCEEDED, 200, answered(7, 2, 5)
    first.save()
    migration.usage_of_lines_answered_before(django_apps, None)
    tokens = lines.values_list("input_tokens", "cached_tokens", "output_tokens")
    assert list(tokens) == [(7, 2, 5), (0, 0, 0), (0, 0, 0)]


def test_a_batch_runs_in_the_project_of_the_key_that_created_it(org_a, tiny_model):
    """Its usage is counted where its creator's is: the runner key is issued in the creating key's project."""
    project = project_create(organization=org_a, name="Nightly jobs")
    issued = api_key_create(organization=org_a, name="jobs", project=project)
    client = bearer_client(issued.key)
    uploaded = upload(client, jsonl(line("r1"), line("r2")))
    batch = create_batch(client, uploaded.data["id"]).data
    runner = Batch.objects.get(public_id=batch["id"]).runner_key
    assert runner.project == project
