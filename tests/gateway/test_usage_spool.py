"""The usage spool: events the control plane could not take survive on disk, once each."""

import socket

import pytest

from gateway.control_plane import ControlPlaneClient
from gateway.usage import UsageReporter, UsageSpool


def event(request_id: str, phase: str = "prefill") -> dict:
    return {"request_id": request_id, "phase": phase, "tokens": 3}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_events_go_to_disk_when_the_control_plane_is_unreachable_and_survive_a_restart(tmp_path):
    path = tmp_path / "spool.sqlite3"
    control_plane = ControlPlaneClient(f"http://127.0.0.1:{closed_port()}", "token", timeout=1.0)
    reporter = UsageReporter(control_plane, UsageSpool(path))
    reporter.record([event("a"), event("a", "decode"), event("b")])
    with pytest.raises(Exception):
        await reporter.flush()
    assert reporter.pending == 3
    await control_plane.close()

    reopened = UsageSpool(path)   # a new gateway process on the same state directory
    assert [e for _, e in reopened.oldest(10)] == [event("a"), event("a", "decode"), event("b")]


def test_the_spool_holds_each_request_and_phase_once(tmp_path):
    spool = UsageSpool(tmp_path / "spool.sqlite3")
    spool.add([event("a"), event("b")])
    spool.add([event("a"), event("a", "decode")])
    assert spool.count() == 3
    rows = spool.oldest(2)
    spool.remove([row_id for row_id, _ in rows])
    assert [e for _, e in spool.oldest(10)] == [event("a", "decode")]


def test_stopping_without_a_control_plane_moves_memory_to_the_spool(tmp_path):
    spool = UsageSpool(tmp_path / "spool.sqlite3")
    reporter = UsageReporter(ControlPlaneClient("http://127.0.0.1:9", "token"), spool)
    reporter.record([event("x"), event("x", "decode")])
    reporter.spool_pending()
    assert spool.count() == 2 and reporter.pending == 2
