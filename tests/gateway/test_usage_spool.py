"""The usage journal: what each execution delivered survives the gateway's death, and every finished
execution's events wait on disk, once each, until the control plane acknowledged them."""

import dataclasses
import json
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from diptych_common.internal_api.messages import UsageEvent
from gateway.accounts.usage import INITIAL_SLOTS, UsageJournal, UsageReporter


def event(request_id: str, phase: str = "prefill", tokens: int = 3) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        client_request_id="",
        phase=phase,
        organization_id="org_1",
        api_key_id="key_1",
        model="diptych-tiny",
        region="local",
        worker_id=f"{phase}-0",
        tokens=tokens,
        cached_tokens=0,
        kv_bytes=0,
        compute_ms=1,
        started_at="2030-01-01T00:00:00+00:00",
        finished_at="2030-01-01T00:00:01+00:00",
    )


def bodies(*events: UsageEvent) -> list[dict]:
    return [e.to_wire() for e in events]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_events_wait_on_disk_while_the_control_plane_is_unreachable_and_survive_a_restart(tmp_path):
    path = tmp_path / "journal.sqlite3"
    control_plane = ControlPlaneClient(f"http://127.0.0.1:{closed_port()}", "token", timeout=1.0)
    journal = UsageJournal(path)
    reporter = UsageReporter(control_plane, journal)
    journal.finish("a", [event("a"), event("a", "decode")])
    journal.finish("b", [event("b")])
    with pytest.raises(ControlPlaneUnavailable):
        await reporter.flush()
    assert reporter.pending == 3
    await control_plane.close()
    journal.close()

    reopened = UsageJournal(path)  # a new gateway process on the same state directory
    rows = [e for _, e in reopened.oldest(10)]
    assert rows == bodies(event("a"), event("a", "decode"), event("b"))
    assert all(set(row) == {field.name for field in dataclasses.fields(UsageEvent)} for row in rows)  # whole events


def test_the_outbox_holds_each_execution_and_phase_once(tmp_path):
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    journal.add([event("a"), event("b")])
    journal.add([event("a"), event("a", "decode")])
    assert journal.count() == 3
    rows = journal.oldest(2)
    journal.remove([row_id for row_id, _ in rows])
    assert [e for _, e in journal.oldest(10)] == bodies(event("a", "decode"))


def test_an_execution_moves_to_the_outbox_in_one_step(tmp_path):
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    journal.track("x", [event("x"), event("x", "decode", tokens=1)], delivered=1)
    journal.count_delivered("x", 5)
    assert journal.unfinished() == 1 and journal.count() == 0
    journal.finish("x", [event("x"), event("x", "decode", tokens=5)])
    assert journal.unfinished() == 0
    assert [e for _, e in journal.oldest(10)] == bodies(event("x"), event("x", "decode", tokens=5))


def test_a_killed_gateway_bills_its_unfinished_executions_for_what_they_delivered_when_it_restarts(tmp_path):
    """A real process counts tokens into the journal and dies by SIGKILL in the middle of a stream."""
    path = tmp_path / "journal.sqlite3"
    script = textwrap.dedent(f"""
        import os, signal
        from gateway.accounts.usage import UsageJournal
        from tests.gateway.test_usage_spool import event
        journal = UsageJournal(__import__("pathlib").Path({str(path)!r}))
        journal.track("streaming", [event("streaming", tokens=40), event("streaming", "decode", 1)], delivered=1)
        for delivered in range(2, 8):
            journal.count_delivered("streaming", delivered)
        journal.track("nothing-yet", [event("nothing-yet", tokens=9), event("nothing-yet", "decode", 1)], delivered=0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == -9

    journal = UsageJournal(path)
    assert len(journal.recover()) == 2
    assert [e for _, e in journal.oldest(10)] == bodies(event("streaming", tokens=40), event("streaming", "decode", 7))
    assert journal.unfinished() == 0
    assert len(journal.recover()) == 0


def test_an_execution_journaled_before_events_had_a_tier_is_billed_at_the_standard_tier(tmp_path):
    """A gateway upgraded over a journal its previous version wrote: the old events lack `tier`."""
    path = tmp_path / "journal.sqlite3"
    UsageJournal(path).close()
    old_shape = [{k: v for k, v in e.to_wire().items() if k != "tier"} for e in (event("old"), event("old", "decode"))]
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO executions (execution_id, events, delivered) VALUES (?, ?, ?)",
            ("old", json.dumps(old_shape), 2),
        )
    journal = UsageJournal(path)
    assert len(journal.recover()) == 1
    assert [e["tier"] for _, e in journal.oldest(10)] == ["standard", "standard"]


def test_a_journal_written_before_counts_had_slots_is_recovered_from_its_rows(tmp_path):
    """A gateway upgraded over a journal whose executions table has no slot column."""
    path = tmp_path / "journal.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE executions (execution_id TEXT PRIMARY KEY, events TEXT NOT NULL, delivered INTEGER)")
        events = [e.to_wire() for e in (event("old"), event("old", "decode"))]
        db.execute("INSERT INTO executions VALUES (?, ?, ?)", ("old", json.dumps(events), 3))
    journal = UsageJournal(path)
    assert len(journal.recover()) == 1
    assert [e for _, e in journal.oldest(10)] == bodies(event("old"), event("old", "decode", tokens=3))


def test_more_executions_at_once_than_the_counts_file_first_holds_keep_their_own_counts(tmp_path):
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    ids = [f"x{i}" for i in range(INITIAL_SLOTS + 5)]
    for index, execution_id in enumerate(ids):
        journal.track(execution_id, [event(execution_id), event(execution_id, "decode")], delivered=1)
        journal.count_delivered(execution_id, index + 1)
    journal.close()

    reopened = UsageJournal(tmp_path / "journal.sqlite3")
    assert len(reopened.recover()) == len(ids)
    decode_tokens = {e["request_id"]: e["tokens"] for _, e in reopened.oldest(10 * len(ids)) if e["phase"] == "decode"}
    assert decode_tokens == {execution_id: index + 1 for index, execution_id in enumerate(ids)}


def test_the_outputs_an_execution_kept_leave_with_it_when_it_finishes(tmp_path):
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    journal.keep_output("exec_1", "a", [1])
    journal.keep_output("exec_1", "b", [2], [{"tokenId": 2, "logprob": -0.5}])
    journal.track("exec_1", [event("exec_1", "decode", 1)], 1)
    assert journal.kept_outputs("exec_1", 5) == [
        {"text": "a", "tokenIds": [1]},
        {"text": "b", "tokenIds": [2], "logprobs": [{"tokenId": 2, "logprob": -0.5}]},
    ]
    assert journal.kept_outputs("exec_1", 1) == [{"text": "a", "tokenIds": [1]}]
    journal.finish("exec_1", [event("exec_1", "decode", 1)])
    assert journal.kept_outputs("exec_1", 5) == []
    assert list((tmp_path / "journal-outputs").iterdir()) == []


def test_kept_outputs_of_several_tokens_each_are_given_back_for_the_tokens_counted(tmp_path):
    """Tokens that arrived together went out in one output: what a restart stores is the outputs whose
    tokens were all counted, never an output counted in part or kept but not yet counted."""
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    journal.keep_output("exec_1", "a", [1])
    journal.keep_output("exec_1", "bcd", [2, 3, 4])
    journal.keep_output("exec_1", "e", [5])
    texts = {count: "".join(o["text"] for o in journal.kept_outputs("exec_1", count)) for count in range(7)}
    assert texts == {0: "", 1: "a", 2: "a", 3: "a", 4: "abcd", 5: "abcde", 6: "abcde"}


def test_a_killed_gateway_bills_the_tokens_of_outputs_of_several_tokens_and_keeps_them(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = UsageJournal(path)
    journal.track("exec_1", [event("exec_1", "prefill"), event("exec_1", "decode", 1)], 1)
    journal.keep_output("exec_1", "a", [1])
    journal.keep_output("exec_1", "bc", [2, 3])
    journal.count_delivered("exec_1", 3)
    journal.keep_output("exec_1", "d", [4])  # killed before it counted
    restarted = UsageJournal(path)
    [recovered] = restarted.recover()
    assert {e.phase: e.tokens for e in recovered.events}["decode"] == 3
    assert recovered.outputs == [{"text": "a", "tokenIds": [1]}, {"text": "bc", "tokenIds": [2, 3]}]
