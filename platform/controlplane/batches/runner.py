"""Runs a batch: sends its unanswered lines to the gateway, a few at a time, and records each answer.

A run lasts one slice (DIPTYCH_BATCH_SLICE_SECONDS) under a lease on the batch; a batch that is not done
runs on in the next slice. Every line is sent with an Idempotency-Key made of the batch and its custom_id:
a line sent again (its runner died before it recorded the answer) gets the gateway's stored answer back
instead of running, and is billed once. The line's row is its durable state; nothing else is kept: it
is marked sent before it leaves, so that a batch cancelled or expired while its runner was dead still gets
the answers of the lines the gateway may have run, rather than reporting them as never run.
"""

import hashlib
import json
import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta

import httpx
from django.conf import settings
from django.utils import timezone

from controlplane.batches.models import Batch, BatchLine, BatchStatus
from controlplane.batches.run_services import (
    LineAnswer,
    batch_finish_if_done,
    batch_lease_claim,
    batch_lease_release,
    batch_lease_renew,
    batch_start,
    line_answered,
    line_postponed,
    line_sending,
    runner_key_secret,
)
from controlplane.batches.selectors import lines_ready

log = logging.getLogger(__name__)

# Answers after which the same request may succeed later: the key's first request still runs (409), rate
# limits (429), the gateway or its workers unavailable (5xx). 409 and 429 are waits, not failures.
RETRYABLE = {409, 429, 500, 502, 503, 504}
UNCOUNTED = {409, 429}
# A 429 for the organization's spend limit is final: the limit holds until it is raised or the billing
# period ends, and a batch retrying until then would sit in progress, to no end the user could see.
SPEND_LIMIT_CODE = "insufficient_quota"
MAX_ATTEMPTS = 5
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class SliceOutcome:
    """How a slice ended: the batch ended, or it goes on now (`go_on`), or another runner holds it."""

    ended: bool = False
    go_on: bool = False
    holder: str = ""


def idempotency_key(batch: Batch, custom_id: str) -> str:
    return f"batch-{batch.public_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:40]}"


class LineSender:
    """Sends one line to the gateway's OpenAI-compatible API as the batch's runner, at batch priority."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch
        self._http = httpx.Client(
            base_url=settings.DIPTYCH_GATEWAY_URL.rstrip("/"),
            headers={"Authorization": f"Bearer {runner_key_secret(batch.public_id)}"},
            timeout=settings.DIPTYCH_BATCH_LINE_TIMEOUT_SECONDS,
        )

    def send(self, custom_id: str, body: dict) -> LineAnswer:
        path = self._batch.endpoint.removeprefix("/v1")
        headers = {"Idempotency-Key": idempotency_key(self._batch, custom_id), "Content-Type": "application/json"}
        # ASCII escapes carry any string a line holds (even a lone surrogate, which UTF-8 cannot): the
        # gateway judges the line, and a line it refuses fails alone instead of stopping the batch.
        content = json.dumps({**body, "priority": "batch"}).encode()
        try:
            response = self._http.post(path, content=content, headers=headers)
        except httpx.HTTPError as error:
            log.warning("batch %s: line %r not answered: %r", self._batch.public_id, custom_id, error)
            return LineAnswer(status_code=None, body=None)
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": {"message": response.text[:1000], "type": "server_error"}}
        return LineAnswer(
            status_code=response.status_code,
            body=answer,
            request_id=response.headers.get("X-Request-Id", ""),
            retry_after_s=_retry_after(response),
        )

    def close(self) -> None:
        self._http.close()


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def run_slice(batch_id: int, holder: str = "") -> SliceOutcome:
    holder = holder or uuid.uuid4().hex
    batch = batch_lease_claim(batch_id=batch_id, holder=holder, now=timezone.now())
    if batch is None:
        return SliceOutcome()
    go_on = False
    try:
        if batch.status == BatchStatus.VALIDATING:
            batch = batch_start(batch=batch)
            if batch.status == BatchStatus.FAILED:
                return SliceOutcome(ended=True)
        if batch.status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
            go_on = _send_lines(batch, holder)
        if batch_finish_if_done(batch=batch, now=timezone.now()):
            return SliceOutcome(ended=True)
    finally:
        if not go_on:
            batch_lease_release(batch=batch, holder=holder)
    return SliceOutcome(go_on=go_on, holder=holder)


def _send_lines(batch: Batch, holder: str) -> bool:
    """Sends lines until none is ready, the slice is over, or the batch is cancelled or expired; waits for
    the lines it sent. True when lines were still ready at the end of the slice."""
    concurrency = max(1, settings.DIPTYCH_BATCH_MAX_CONCURRENT_LINES)
    slice_end = time.monotonic() + settings.DIPTYCH_BATCH_SLICE_SECONDS
    renew_every_s = max(1.0, settings.DIPTYCH_BATCH_LEASE_SECONDS / 3)
    sender = LineSender(batch)
    in_flight: dict[Future, BatchLine] = {}
    slice_over = False
    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"batch-{batch.id}") as pool:
            while True:
                slice_over = time.monotonic() >= slice_end
                if not slice_over:
                    sending = {line.id for line in in_flight.values()}
                    for line in _lines_to_send(batch, exclude=sending, limit=concurrency - len(in_flight)):
                        line_sending(line=line)
                        in_flight[pool.submit(sender.send, line.custom_id, line.body)] = line
                if not in_flight:
                    break
                done, _ = wait(in_flight, timeout=renew_every_s, return_when=FIRST_COMPLETED)
                for future in done:
                    _record(in_flight.pop(future), future.result())
                batch_lease_renew(batch=batch, holder=holder)
    finally:
        sender.close()
    return slice_over and bool(_lines_to_send(batch, exclude=set(), limit=1))


def _lines_to_send(batch: Batch, *, exclude: set[int], limit: int) -> list[BatchLine]:
    """The ready lines of a running batch; once it is cancelled or expired, only the lines it sent before,
    sent again under their idempotency keys to get the answers of those the gateway ran."""
    running = _still_running(batch)
    return lines_ready(batch=batch, now=timezone.now(), exclude=exclude, limit=limit, sent_only=not running)


def _still_running(batch: Batch) -> bool:
    current = Batch.objects.filter(id=batch.id).values_list("status", "expires_at").first()
    return current is not None and current[0] == BatchStatus.IN_PROGRESS and timezone.now() < current[1]


def _record(line: BatchLine, answer: LineAnswer) -> None:
    retryable = answer.status_code is None or (answer.status_code in RETRYABLE and not _over_spend_limit(answer))
    counted = answer.status_code not in UNCOUNTED
    if not retryable or (counted and line.attempts + 1 >= MAX_ATTEMPTS):
        line_answered(line=line, answer=answer)
        return
    wait_s = answer.retry_after_s if answer.retry_after_s is not None else min(MAX_BACKOFF_S, 2.0**line.attempts)
    may_have_run = answer.status_code in (None, 409)  # no answer, or the key's first request still runs
    line_postponed(
        line=line, not_before=timezone.now() + timedelta(seconds=wait_s), counted=counted, may_have_run=may_have_run
    )


def _over_spend_limit(answer: LineAnswer) -> bool:
    error = (answer.body or {}).get("error")
    return answer.status_code == 429 and isinstance(error, dict) and error.get("code") == SPEND_LIMIT_CODE
