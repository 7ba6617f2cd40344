"""What the platform reports of the chaos run's batches once they have ended: every batch of every
organization on the control plane's Batch API (a batch made by a create whose answer was lost included),
its input file's custom_ids and what its output and error files say of each, for
`bench.chaos.batch_ledger` to set against the ledger."""

import json
import time

import httpx

from bench.chaos.batch_ledger import TERMINAL, BatchRecord, ReportedLine
from bench.chaos.batch_load import CALL_DEADLINE_S, CALL_TIMEOUT_S, RETRY_PAUSE_S, BatchCallError, bearer

PAGE = 100


def wait_until_ended(control_plane_url: str, api_keys: dict[str, str], timeout_s: float) -> list[str]:
    """Waits until every batch of every organization has ended; returns the ids of those that did not."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [
            batch["id"]
            for key in api_keys.values()
            for batch in _list_batches(control_plane_url, key)
            if batch["status"] not in TERMINAL
        ]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(1.0)


def collect(control_plane_url: str, api_keys: dict[str, str], runner_keys: dict[str, str]) -> list[BatchRecord]:
    """Every batch of every organization as the control plane's Batch API reports it: its input file's
    custom_ids and, per custom_id, what its output and error files say. `runner_keys`: batch id -> the
    public id of the key it ran with (the API does not show it)."""
    records = []
    for organization_id, key in sorted(api_keys.items()):
        for batch in reversed(_list_batches(control_plane_url, key)):
            custom_ids = [
                json.loads(row)["custom_id"] for row in _file_rows(control_plane_url, key, batch["input_file_id"])
            ]
            reported: list[ReportedLine] = []
            for kind, file_id in (("output", batch.get("output_file_id")), ("error", batch.get("error_file_id"))):
                for row in _file_rows(control_plane_url, key, file_id):
                    reported.append(_reported_line(kind, json.loads(row)))
            records.append(
                BatchRecord(
                    batch_id=batch["id"],
                    organization_id=organization_id,
                    runner_key_id=runner_keys.get(batch["id"], ""),
                    status=batch["status"],
                    custom_ids=custom_ids,
                    reported=reported,
                    request_counts=batch.get("request_counts") or {},
                )
            )
    return records


def _reported_line(kind: str, record: dict) -> ReportedLine:
    response = record.get("response") or {}
    usage = (response.get("body") or {}).get("usage") or {}
    return ReportedLine(
        custom_id=record["custom_id"],
        file=kind,
        status_code=response.get("status_code"),
        request_id=response.get("request_id") or "",
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        error_code=(record.get("error") or {}).get("code") or "",
    )


def _list_batches(control_plane_url: str, key: str) -> list[dict]:
    """Every batch of the key's organization, newest first."""
    batches: list[dict] = []
    after = None
    while True:
        params: dict[str, str | int] = {"limit": PAGE, **({"after": after} if after else {})}
        page = _get(control_plane_url, "/api/v1/batches", key, params).json()
        batches += page["data"]
        if not page["has_more"]:
            return batches
        after = page["last_id"]


def _file_rows(control_plane_url: str, key: str, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    return _get(control_plane_url, f"/api/v1/files/{file_id}/content", key).text.splitlines()


def _get(control_plane_url: str, path: str, key: str, params: dict | None = None) -> httpx.Response:
    """The GET's 200 answer, asked again after a transport error, a 429 or a 5xx (a loaded machine's control
    plane may be slow to answer once, and the run should not end for it) until CALL_DEADLINE_S has passed."""
    deadline = time.monotonic() + CALL_DEADLINE_S
    while True:
        try:
            response = httpx.get(
                f"{control_plane_url}{path}", params=params, headers=bearer(key), timeout=CALL_TIMEOUT_S
            )
            if response.status_code == 200:
                return response
            if response.status_code != 429 and response.status_code < 500:
                raise BatchCallError(f"GET {path} answered {response.status_code}: {response.text[:500]}")
            reason = str(response.status_code)
        except httpx.TransportError as error:
            reason = type(error).__name__
        if time.monotonic() > deadline:
            raise BatchCallError(f"GET {path} unanswered for {CALL_DEADLINE_S:.0f} s; last: {reason}")
        time.sleep(RETRY_PAUSE_S)
