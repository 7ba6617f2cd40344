"""Usage events: one per request and phase, sent to the control plane in batches.

The control plane stores each (request id, phase) once, so a batch sent again after a lost answer
counts once. When the control plane cannot be reached, the batch goes to a durable local spool (a
SQLite file, synchronous=FULL, so each commit is fsync'd) and is replayed from there when the control
plane answers again; an event leaves the spool only after the control plane acknowledged it. Spooling
happens before the in-memory copy is dropped, so no event is lost between the two.
"""

import asyncio
import json
import logging
import sqlite3
from pathlib import Path

from gateway.control_plane import ControlPlaneClient
from gateway.metrics import USAGE_SPOOLED

log = logging.getLogger(__name__)

BATCH_SIZE = 500


class UsageSpool:
    """Events waiting for the control plane, on disk; unique on (request id, phase)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS usage_events ("
            " id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, phase TEXT NOT NULL,"
            " body TEXT NOT NULL, UNIQUE (request_id, phase))"
        )
        USAGE_SPOOLED.set(self.count())

    def add(self, events: list[dict]) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT OR IGNORE INTO usage_events (request_id, phase, body) VALUES (?, ?, ?)",
                [(e["request_id"], e["phase"], json.dumps(e)) for e in events],
            )
        USAGE_SPOOLED.set(self.count())

    def oldest(self, limit: int) -> list[tuple[int, dict]]:
        rows = self._db.execute("SELECT id, body FROM usage_events ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [(row_id, json.loads(body)) for row_id, body in rows]

    def remove(self, row_ids: list[int]) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM usage_events WHERE id = ?", [(i,) for i in row_ids])
        USAGE_SPOOLED.set(self.count())

    def count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0]

    def close(self) -> None:
        self._db.close()


class UsageReporter:
    def __init__(self, control_plane: ControlPlaneClient, spool: UsageSpool, flush_interval_s: float = 0.1) -> None:
        self._control_plane = control_plane
        self._spool = spool
        self._flush_interval_s = flush_interval_s
        self._pending: list[dict] = []

    def record(self, events: list[dict]) -> None:
        self._pending.extend(events)

    @property
    def pending(self) -> int:
        return len(self._pending) + self._spool.count()

    async def flush(self) -> None:
        """Sends what is in memory (spooling it when the control plane fails), then replays the spool."""
        while self._pending:
            batch = self._pending[:BATCH_SIZE]
            try:
                await self._control_plane.post_usage_events(batch)
            except Exception:
                self._spool.add(batch)
                del self._pending[: len(batch)]
                raise
            del self._pending[: len(batch)]
        while rows := self._spool.oldest(BATCH_SIZE):
            await self._control_plane.post_usage_events([event for _, event in rows])
            self._spool.remove([row_id for row_id, _ in rows])

    def spool_pending(self) -> None:
        """Moves what is in memory to the spool (when stopping without a control plane)."""
        if self._pending:
            self._spool.add(self._pending)
            self._pending.clear()

    async def flush_forever(self) -> None:
        backoff = self._flush_interval_s
        while True:
            await asyncio.sleep(backoff)
            try:
                await self.flush()
                backoff = self._flush_interval_s
            except Exception as error:  # every event is in memory or in the spool; try again later
                backoff = min(backoff * 2, 2.0)
                log.warning("cannot send usage events yet (%d waiting): %r", self.pending, error)
