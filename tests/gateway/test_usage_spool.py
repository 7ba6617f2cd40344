"""The usage journal: what each execution delivered survives the gateway's death, and every finished
execution's events wait on disk, once each, until the control plane acknowledged them."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from gateway.control_plane import ControlPlaneClient
from gateway.usage import UsageJournal, UsageReporter


def event(request_id: str, phase: str = "prefill", tokens: int = 3) -> dict:
    return {"request_id": request_id, "phase": phase, "tokens": tokens}


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
    with pytest.raises(Exception):
        await reporter.flush()
    assert reporter.pending == 3
    await control_plane.close()
    journal.close()

    reopened = UsageJournal(path)   # a new gateway process on the same state directory
    assert [e for _, e in reopened.oldest(10)] == [event("a"), event("a", "decode"), event("b")]


def test_the_outbox_holds_each_execution_and_phase_once(tmp_path):
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    journal.add([event("a"), event("b")])
    journal.add([event("a"), event("a", "decode")])
    assert journal.count() == 3
    rows = journal.oldest(2)
    journal.remove([row_id for row_id, _ in rows])
    assert [e for _, e in journal.oldest(10)] == [event("a", "decode")]


def test_an_execution_moves_to_the_outbox_in_one_step(tmp_path):
    journal = UsageJournal(tmp_path / "journal.sqlite3")
    journal.track("x", [event("x"), event("x", "decode", tokens=1)], delivered=1)
    journal.count_delivered("x", 5)
    assert journal.unfinished() == 1 and journal.count() == 0
    journal.finish("x", [event("x"), event("x", "decode", tokens=5)])
    assert journal.unfinished() == 0
    assert [e for _, e in journal.oldest(10)] == [event("x"), event("x", "decode", tokens=5)]


def test_a_killed_gateway_bills_its_unfinished_executions_for_what_they_delivered_when_it_restarts(tmp_path):
    """A real process counts tokens into the journal and dies by SIGKILL in the middle of a stream."""
    path = tmp_path / "journal.sqlite3"
    script = textwrap.dedent(f"""
        import os, signal
        from gateway.usage import UsageJournal
        journal = UsageJournal(__import__("pathlib").Path({str(path)!r}))
        journal.track("streaming", [{{"request_id": "streaming", "phase": "prefill", "tokens": 40}},
                                    {{"request_id": "streaming", "phase": "decode", "tokens": 1}}], delivered=1)
        for delivered in range(2, 8):
            journal.count_delivered("streaming", delivered)
        journal.track("nothing-yet", [{{"request_id": "nothing-yet", "phase": "prefill", "tokens": 9}},
                                      {{"request_id": "nothing-yet", "phase": "decode", "tokens": 1}}], delivered=0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == -9

    journal = UsageJournal(path)
    assert journal.recover() == 2
    assert [e for _, e in journal.oldest(10)] == [
        {"request_id": "streaming", "phase": "prefill", "tokens": 40},
        {"request_id": "streaming", "phase": "decode", "tokens": 7},
    ]
    assert journal.unfinished() == 0
    assert journal.recover() == 0
