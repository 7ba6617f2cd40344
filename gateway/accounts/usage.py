"""Usage: the gateway's durable journal of what each execution delivered, and its events on their way to
the control plane.

The journal is a SQLite file in the gateway's state directory with two tables:

- `executions`: one row per execution that is writing tokens to a client, with its usage events as they
  stand (minus the count of tokens delivered) and the slot that holds that count in the journal's counts
  file. Before the gateway writes a token, the count says so: a store into the memory-mapped counts file,
  which the kernel keeps when the process is killed, as it keeps a committed write to the WAL, at the
  cost of a memory write rather than a transaction per token.
- `outbox`: usage events of finished executions, until the control plane acknowledged them. An
  execution's row moves to the outbox in one transaction when its stream ends.
- `idempotency_keys`: the idempotency keys this gateway claims or holds, until the control plane has
  stored the answer or freed the key; a restarted gateway frees those a killed run left held.

Beside them, an execution with an idempotency key keeps each output it hands over in a file of its own
(`outputs/<execution id>`), appended before the output counts: gRPC's client library drops the messages
it had received but not yet read when a connection breaks, so what a client of a killed gateway read may
be less than what was handed over. The outputs let the gateway's next run store what was handed over, and
billed, as the key's answer (`IdempotencyKeys.settle_held`): a retry under the key fetches all of it.

A gateway that was killed finds its unfinished executions when it starts on the same state directory and
bills each for the tokens its journal counted (`recover`). The control plane stores each (execution id,
phase) once, so an event sent again after a lost answer counts once.
"""

import asyncio
import dataclasses
import json
import logging
import mmap
import os
import sqlite3
import struct
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from opentelemetry.trace import Span, SpanKind, StatusCode

from diptych_common.internal_api.client import ControlPlaneClient
from diptych_common.internal_api.messages import UsageEvent
from diptych_common.logs import describe_error
from diptych_common.tracing import TRACEPARENT, context_from_traceparent, start_span, traceparent_of
from gateway.metrics import USAGE_SPOOLED

log = logging.getLogger(__name__)

BATCH_SIZE = 500
_OUTPUT_LINE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
COUNT = struct.Struct("<q")
INITIAL_SLOTS = 1024


class DeliveredCounts:
    """Each unfinished execution's delivered count, in a slot of a memory-mapped file: `set` is a plain
    memory write that survives a kill of the process (the page belongs to the kernel's page cache), and
    the file holds as many slots as executions ever ran at once."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a+b")
        if self._file.seek(0, 2) < INITIAL_SLOTS * COUNT.size:
            self._file.truncate(INITIAL_SLOTS * COUNT.size)
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._free = list(range(len(self._map) // COUNT.size - 1, -1, -1))

    def claim(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def set(self, slot: int, count: int) -> None:
        COUNT.pack_into(self._map, slot * COUNT.size, count)

    def get(self, slot: int) -> int:
        count: int = COUNT.unpack_from(self._map, slot * COUNT.size)[0]
        return count

    def close(self) -> None:
        self._map.close()
        self._file.close()

    def _grow(self) -> None:
        slots = len(self._map) // COUNT.size
        self._map.resize(2 * slots * COUNT.size)
        self._free.extend(range(2 * slots - 1, slots - 1, -1))


class Recovered(NamedTuple):
    """An execution a killed run left unfinished, as billed: its events and the outputs it had handed over
    (kept only for an execution with an idempotency key), each as `stored_response` writes it."""

    execution_id: str
    events: list[UsageEvent]
    outputs: list[dict[str, Any]]


class HeldKey(NamedTuple):
    """An idempotency key that an execution of this gateway claimed and has not settled yet."""

    execution_id: str
    organization_id: str
    key: str

    def as_body(self) -> dict[str, Any]:
        """As the control plane's idempotency endpoints name it."""
        return {"organization_id": self.organization_id, "key": self.key, "execution_id": self.execution_id}


class UsageJournal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # Every commit reaches the OS before the gateway goes on, so a killed process loses nothing; a
        # checkpoint fsyncs the file (a machine that loses power can lose the last commits before it).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS executions ("
            " execution_id TEXT PRIMARY KEY, events TEXT NOT NULL, delivered INTEGER NOT NULL)"
        )
        if "slot" not in {row[1] for row in self._db.execute("PRAGMA table_info(executions)")}:
            self._db.execute("ALTER TABLE executions ADD COLUMN slot INTEGER")  # journals written before slots
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS outbox ("
            " id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, phase TEXT NOT NULL,"
            " body TEXT NOT NULL, UNIQUE (request_id, phase))"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS idempotency_keys ("
            " execution_id TEXT PRIMARY KEY, organization_id TEXT NOT NULL, key TEXT NOT NULL)"
        )
        # Trace contexts of the requests whose events wait in the outbox, for their usage.ingest spans
        # (kept in memory: a restarted gateway sends what it recovered untraced).
        self.traceparents: dict[str, str] = {}
        self._counts = DeliveredCounts(path.with_name(path.stem + "-delivered.counts"))
        self._slots: dict[str, int] = {}  # execution id -> its slot in the counts file
        self._outputs_dir = path.with_name(path.stem + "-outputs")
        self._outputs_dir.mkdir(exist_ok=True)
        self._output_files: dict[str, int] = {}  # execution id -> its open outputs file
        USAGE_SPOOLED.set(self.count())

    # ---- executions in progress -----------------------------------------------------------------

    def track(self, execution_id: str, events: list[UsageEvent], delivered: int) -> None:
        """Records an execution's events (their `tokens` of output set from `delivered`) and its count."""
        slot = self._slots.get(execution_id)
        if slot is None:
            slot = self._slots[execution_id] = self._counts.claim()
        self._counts.set(slot, delivered)  # before the row names the slot: a row never reads a stale count
        self._db.execute(
            "INSERT INTO executions (execution_id, events, delivered, slot) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (execution_id) DO UPDATE SET events = excluded.events, delivered = excluded.delivered",
            (execution_id, json.dumps([event.to_wire() for event in events]), delivered, slot),
        )

    def count_delivered(self, execution_id: str, delivered: int) -> None:
        """The execution (tracked) has delivered `delivered` tokens: called before each is handed over."""
        self._counts.set(self._slots[execution_id], delivered)

    def keep_output(
        self, execution_id: str, text: str, token_ids: list[int], logprobs: list[dict[str, Any]] | None = None
    ) -> None:
        """Appends an output of a keyed execution (`logprobs` as the stored answer writes them), before it
        counts: a count never names a missing output. One short JSON line, a few microseconds."""
        descriptor = self._output_files.get(execution_id)
        if descriptor is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC
            descriptor = self._output_files[execution_id] = os.open(self._outputs_path(execution_id), flags, 0o600)
        line = [text, token_ids] if logprobs is None else [text, token_ids, logprobs]
        os.write(descriptor, (_OUTPUT_LINE(line) + "\n").encode())

    def kept_outputs(self, execution_id: str, tokens: int) -> list[dict[str, Any]]:
        """The outputs an execution kept that hold its first `tokens` output tokens (all it kept, if they
        hold fewer), in the stored answer's names (`text`, `tokenIds`, `logprobs`). An output kept but not
        counted (the gateway stopped between the two) is not among them."""
        try:
            lines = self._outputs_path(execution_id).read_bytes().splitlines()
        except FileNotFoundError:
            return []
        kept: list[dict[str, Any]] = []
        for text, token_ids, *logprobs in map(json.loads, lines):
            tokens -= len(token_ids)
            if tokens < 0:
                break
            kept.append({"text": text, "tokenIds": token_ids} | ({"logprobs": logprobs[0]} if logprobs else {}))
        return kept

    def drop_outputs(self, execution_id: str) -> None:
        descriptor = self._output_files.pop(execution_id, None)
        if descriptor is not None:
            os.close(descriptor)
        self._outputs_path(execution_id).unlink(missing_ok=True)

    def _outputs_path(self, execution_id: str) -> Path:
        return self._outputs_dir / execution_id.replace("/", "_")

    def finish(
        self, execution_id: str, events: list[UsageEvent], traceparent: str = "", keep_outputs: bool = False
    ) -> None:
        """The execution ended: its final events go to the outbox and its row leaves, atomically; its kept
        outputs go too, unless `keep_outputs` (a recovered execution's, until its key is settled)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._add_to_outbox(events)
            self._db.execute("DELETE FROM executions WHERE execution_id = ?", (execution_id,))
        slot = self._slots.pop(execution_id, None)
        if slot is not None:  # only once no row names it
            self._counts.release(slot)
        if not keep_outputs and execution_id in self._output_files:
            self.drop_outputs(execution_id)
        if traceparent and events:
            self.traceparents[execution_id] = traceparent
        USAGE_SPOOLED.set(self.count())

    def recover(self) -> list[Recovered]:
        """Bills every execution a killed gateway left unfinished for the tokens it had counted; returns
        them with the outputs they kept, which stay on disk until `drop_outputs`."""
        rows = self._db.execute("SELECT execution_id, events, delivered, slot FROM executions").fetchall()
        recovered = []
        for execution_id, events, delivered, slot in rows:
            if slot is not None:
                delivered = self._counts.get(slot)
            billed = with_delivered([UsageEvent.from_wire(event) for event in json.loads(events)], delivered)
            self.finish(execution_id, billed, keep_outputs=True)
            recovered.append(Recovered(execution_id, billed, self.kept_outputs(execution_id, delivered)))
        return recovered

    # ---- the outbox ------------------------------------------------------------------------------

    def add(self, events: list[UsageEvent]) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._add_to_outbox(events)
        USAGE_SPOOLED.set(self.count())

    def _add_to_outbox(self, events: list[UsageEvent]) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO outbox (request_id, phase, body) VALUES (?, ?, ?)",
            [(e.request_id, e.phase, json.dumps(e.to_wire())) for e in events],
        )

    def oldest(self, limit: int) -> list[tuple[int, dict[str, Any]]]:
        """The outbox's oldest events, as the control plane takes them (`UsageEvent.to_wire()`)."""
        rows = self._db.execute("SELECT id, body FROM outbox ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [(row_id, json.loads(body)) for row_id, body in rows]

    def remove(self, row_ids: list[int]) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in row_ids])
        USAGE_SPOOLED.set(self.count())

    def count(self) -> int:
        rows: int = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
        return rows

    def unfinished(self) -> int:
        rows: int = self._db.execute("SELECT COUNT(*) FROM executions").fetchone()[0]
        return rows

    # ---- idempotency keys held ---------------------------------------------------------------------

    def hold_idempotency_key(self, held: HeldKey) -> None:
        self._db.execute("INSERT OR IGNORE INTO idempotency_keys VALUES (?, ?, ?)", held)

    def drop_idempotency_key(self, execution_id: str) -> None:
        self._db.execute("DELETE FROM idempotency_keys WHERE execution_id = ?", (execution_id,))

    def held_idempotency_keys(self) -> list[HeldKey]:
        rows = self._db.execute("SELECT execution_id, organization_id, key FROM idempotency_keys").fetchall()
        return [HeldKey(*row) for row in rows]

    def close(self) -> None:
        for descriptor in self._output_files.values():
            os.close(descriptor)
        self._db.close()
        self._counts.close()


def with_delivered(events: list[UsageEvent], delivered: int) -> list[UsageEvent]:
    """The events of an execution that delivered `delivered` output tokens: none when it delivered none
    (the prompt of a request that produced nothing for the client is not billed)."""
    if delivered <= 0:
        return []
    return [dataclasses.replace(e, tokens=delivered) if e.phase == "decode" else e for e in events]


class UsageReporter:
    """Sends the journal's outbox to the control plane, oldest first; a row leaves only once acknowledged."""

    def __init__(self, control_plane: ControlPlaneClient, journal: UsageJournal, flush_interval_s: float = 0.1) -> None:
        self._control_plane = control_plane
        self.journal = journal
        self._flush_interval_s = flush_interval_s

    @property
    def pending(self) -> int:
        return self.journal.count()

    async def flush(self) -> None:
        while rows := self.journal.oldest(BATCH_SIZE):
            events = [UsageEvent.from_wire(body) for _, body in rows]
            spans = self._ingest_spans(events)
            try:
                headers = {TRACEPARENT: traceparent_of(spans[0])} if spans else {}
                await self._control_plane.post_usage_events(events, headers)
            except Exception as error:
                for span in spans:
                    span.set_status(StatusCode.ERROR, describe_error(error))
                    span.end()
                raise
            self.journal.remove([row_id for row_id, _ in rows])
            for execution_id in {event.request_id for event in events}:
                self.journal.traceparents.pop(execution_id, None)
            for span in spans:
                span.end()

    def _ingest_spans(self, events: list[UsageEvent]) -> list[Span]:
        """One usage.ingest span in the trace of each traced request whose events this batch carries."""
        parents = {self.journal.traceparents.get(event.request_id, "") for event in events} - {""}
        return [
            start_span(
                "usage.ingest",
                context_from_traceparent(parent),
                kind=SpanKind.CLIENT,
                attributes={"events": len(events)},
            )
            for parent in sorted(parents)
        ]

    async def flush_forever(self) -> None:
        await flush_forever(self, "usage events", self._flush_interval_s)


class Reporter(Protocol):
    """What goes to the control plane in batches: `flush` sends what waits, or raises and keeps it."""

    @property
    def pending(self) -> int: ...

    async def flush(self) -> None: ...


async def flush_forever(reporter: Reporter, what: str, interval_s: float) -> None:
    """Flushes every `interval_s`; after a failure, less often (up to every 2 s) until one succeeds."""
    backoff = interval_s
    while True:
        await asyncio.sleep(backoff)
        try:
            await reporter.flush()
            backoff = interval_s
        except Exception as error:  # everything stays with the reporter; try again later
            backoff = min(backoff * 2, 2.0)
            log.warning("cannot send %s yet (%d waiting): %r", what, reporter.pending, error)
