"""What each phase of a request did, filled in as it runs: the usage it is billed for, the routing
decision, its attempts, and the workers its sibling choices reuse."""

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime

from opentelemetry.trace import INVALID_SPAN, Span

from gateway.fleet.registry import WorkerInfo
from gateway.routing.route import Decision, Pin


@dataclass
class PhaseRecord:
    worker: WorkerInfo
    started_at: datetime
    finished_at: datetime | None = None
    compute_ms: int = 0
    kv_bytes: int = 0
    cached_tokens: int = 0


@dataclass
class RequestTrace:
    """What each phase did, for usage: filled in as the request runs."""

    prefill: PhaseRecord | None = None
    decode: PhaseRecord | None = None
    decision: Decision | None = None
    attempts: int = 0
    request_faults: int = 0
    span: Span = INVALID_SPAN  # the request's gateway.request span: each attempt's span goes under it
    pin: Pin | None = None  # the workers to reuse (an n>1 request's later choices)
    # Set once the prompt's KV cache is where a sibling choice finds it: on the colocated worker after the
    # first token; in split mode once the decode worker sent a token (it admitted the handed-off blocks,
    # named in its prefix cache, and the prefill worker named them when it computed them).
    prompt_shared: asyncio.Event = field(default_factory=asyncio.Event)

    def pin_here(self) -> Pin | None:
        """The workers that hold this request's prompt now, for its sibling choices."""
        if self.prefill is None:
            return None
        decode = self.decode.worker.id if self.decode is not None else self.prefill.worker.id
        return Pin(self.prefill.worker.id, decode)

    @property
    def mode(self) -> str:
        """The routing decision as a metric label; empty before the request was routed."""
        return self.decision.value if self.decision is not None else ""

    def attempt_id(self, execution_id: str) -> str:
        """Each attempt's own id on the workers, so that a retry never meets the attempt it replaces."""
        return f"{execution_id}.{self.attempts}"


def record_prefill(
    trace: RequestTrace, worker: WorkerInfo, started: datetime, compute_ms: int, cached: int
) -> PhaseRecord:
    """The first prefill is the one billed; a prefill re-run after a failure only adds compute time."""
    if trace.prefill is None:
        trace.prefill = PhaseRecord(worker, started_at=started, finished_at=now(), cached_tokens=cached)
    trace.prefill.compute_ms += compute_ms
    return trace.prefill


def start_decode(trace: RequestTrace, worker: WorkerInfo) -> PhaseRecord:
    if trace.decode is None:
        trace.decode = PhaseRecord(worker, started_at=now())
    else:
        trace.decode.worker = worker  # the stream moved: the last decode worker is the one on record
    return trace.decode


def finish_trace(trace: RequestTrace) -> None:
    if trace.decode is not None and trace.decode.finished_at is None:
        trace.decode.finished_at = now()


def now() -> datetime:
    return datetime.now(UTC)
