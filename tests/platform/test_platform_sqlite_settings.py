"""Every SQLite database the control plane opens waits for concurrent writers instead of failing with
"database is locked": the embedded default and a `sqlite:///` DATABASE_URL alike."""

import sqlite3
import threading

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler

from controlplane import settings as controlplane_settings
from controlplane.settings import database_settings

WAITS_FOR_WRITERS = {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
COMPETING_WRITE_WINDOW_S = 1.0  # how long the claim gives a competing write to slip in between its read and write


def test_a_sqlite_url_gets_the_options_of_the_embedded_database(tmp_path, monkeypatch):
    monkeypatch.setattr(controlplane_settings, "STATE_DIR", tmp_path / "state")
    embedded = database_settings("")
    from_url = database_settings(f"sqlite:///{tmp_path / 'controlplane.sqlite3'}")
    assert embedded.get("OPTIONS") == WAITS_FOR_WRITERS
    assert from_url.get("OPTIONS") == WAITS_FOR_WRITERS
    assert from_url.get("NAME") == str(tmp_path / "controlplane.sqlite3")


def test_options_a_sqlite_url_names_itself_win_over_the_defaults(tmp_path):
    options = database_settings(f"sqlite:///{tmp_path / 'controlplane.sqlite3'}?timeout=3").get("OPTIONS")
    assert options == {**WAITS_FOR_WRITERS, "timeout": 3}


def test_a_postgres_url_gets_no_sqlite_options():
    assert "OPTIONS" not in database_settings("postgres://diptych:secret@127.0.0.1:5432/diptych")


def test_a_transaction_that_reads_then_writes_waits_for_a_concurrent_writer(tmp_path, django_db_blocker):
    """An idempotency claim reads whether its key is free, then takes it. With deferred transactions a write
    by another connection in between makes the claim fail at once with "database is locked", whatever the
    timeout; an immediate transaction holds the write lock from its start, so the other writer waits."""
    path = tmp_path / "race.sqlite3"
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE claims (key TEXT PRIMARY KEY)")
    database = database_settings(f"sqlite:///{path}")
    claim_read, competitor_wrote = threading.Event(), threading.Event()
    failures: list[OperationalError] = []

    def claim() -> None:
        connection = ConnectionHandler({"default": dict(database)})["default"]
        try:
            connection.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)  # as atomic()
            with connection.cursor() as cursor:
                cursor.execute("SELECT COUNT(*) FROM claims WHERE key = 'key'")
                claim_read.set()
                competitor_wrote.wait(COMPETING_WRITE_WINDOW_S)  # never set while this transaction holds the lock
                cursor.execute("INSERT INTO claims VALUES ('key')")
            connection.commit()
        except OperationalError as error:
            failures.append(error)
        finally:
            connection.close()

    with django_db_blocker.unblock():
        claimer = threading.Thread(target=claim)
        claimer.start()
        assert claim_read.wait(10), "the claim never read"
        competitor = ConnectionHandler({"default": dict(database)})["default"]
        try:
            with competitor.cursor() as cursor:
                cursor.execute("INSERT INTO claims VALUES ('another key')")
            competitor_wrote.set()
        finally:
            competitor.close()
        claimer.join(30)

    assert not claimer.is_alive()
    assert failures == []
    with sqlite3.connect(path) as check:
        assert sorted(key for (key,) in check.execute("SELECT key FROM claims")) == ["another key", "key"]


@pytest.mark.parametrize("url", ["sqlite:///{path}", ""])
def test_the_options_reach_the_connection(tmp_path, monkeypatch, django_db_blocker, url):
    monkeypatch.setattr(controlplane_settings, "STATE_DIR", tmp_path)
    database = database_settings(url.format(path=tmp_path / "controlplane.sqlite3"))
    connection = ConnectionHandler({"default": dict(database)})["default"]
    with django_db_blocker.unblock():
        try:
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA journal_mode")
                assert cursor.fetchone() == ("wal",)
                cursor.execute("PRAGMA busy_timeout")
                assert cursor.fetchone() == (20_000,)
            assert connection.transaction_mode == "IMMEDIATE"
        finally:
            connection.close()
