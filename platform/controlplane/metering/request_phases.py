"""A request's phases on a time line, built from its ledger events (at most one prefill and one decode).

What each timing means, from what the gateway records (gateway/core/request_path.py):

- prefill: from the gateway's Prefill call to the first token it got back (queueing on the worker
  included). `queued_ms` is that wall time minus the worker's `compute_ms`: the time the prompt waited or
  travelled rather than ran. The time line draws it first, then the compute.
- kv_handoff: `kv_bytes` is what the prefill worker reported sending. Its time is the gap from the prefill
  event's `finished_at` to the decode event's `started_at` (0 when they touch). The gateway starts the decode
  phase's clock as soon as the first token is in, so the transfer itself, which overlaps the first decode
  steps, is inside the decode phase's time; the worker's own transfer time is a metric
  (`diptych_gateway_kv_transfer_seconds`), not a ledger field.
- decode: from the first token to the last; `compute_ms` is the decode worker's compute.
- colocated: one worker did both and no KV cache moved (a colocated route, a split route whose decode
  worker ran the prompt itself, or a request ended by its first token): one phase from the prompt's start
  to the last token, with the prefill's `queued_ms` (time to first token minus its compute). Its
  `compute_ms` is the whole call's, which the worker reports with the last token (the decode event's).
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.metering.models import Phase, UsageEvent


class PhaseKind:
    PREFILL = "prefill"
    KV_HANDOFF = "kv_handoff"
    DECODE = "decode"
    COLOCATED = "colocated"
    CHOICES = (PREFILL, KV_HANDOFF, DECODE, COLOCATED)


class Route:
    SPLIT = "split"
    COLOCATED = "colocated"
    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"  # choice i >= 1 of an n > 1 request: its prompt is billed on choice 0
    CHOICES = (SPLIT, COLOCATED, PREFILL_ONLY, DECODE_ONLY)


def milliseconds(span: timedelta) -> float:
    return round(span / timedelta(milliseconds=1), 3)


@dataclass(frozen=True)
class RequestPhase:
    kind: str
    started_at: datetime
    finished_at: datetime
    offset_ms: float  # from the request's start
    worker_id: str | None = None
    compute_ms: int | None = None
    queued_ms: float | None = None
    computed_tokens: int | None = None  # prompt tokens computed: the prompt less its cached tokens
    cached_tokens: int | None = None
    output_tokens: int | None = None
    kv_bytes: int | None = None

    @property
    def duration_ms(self) -> float:
        return milliseconds(self.finished_at - self.started_at)


@dataclass(frozen=True)
class RequestTotals:
    prompt_tokens: int
    computed_tokens: int
    cached_tokens: int
    output_tokens: int
    kv_bytes: int
    compute_ms: int


@dataclass(frozen=True)
class RequestTimeline:
    request_id: str
    client_request_id: str
    model: str
    tier: str
    api_key_id: str
    project_id: str
    route: str
    started_at: datetime
    finished_at: datetime
    time_to_first_token_ms: float | None
    phases: list[RequestPhase]
    totals: RequestTotals
    events: list[UsageEvent]

    @property
    def duration_ms(self) -> float:
        return milliseconds(self.finished_at - self.started_at)


def request_timeline(events: list[UsageEvent]) -> RequestTimeline:
    """The phases of one request from its events (which need their api_key and project loaded)."""
    if not events or len({event.request_id for event in events}) != 1:
        raise ValueError("A time line is built from the events of exactly one request.")
    by_phase = {event.phase: event for event in events}
    prefill, decode = by_phase.get(Phase.PREFILL), by_phase.get(Phase.DECODE)
    started_at = min(event.started_at for event in events)
    finished_at = max(event.finished_at for event in events)
    first = prefill or decode
    assert first is not None
    return RequestTimeline(
        request_id=first.request_id,
        client_request_id=first.client_request_id,
        model=first.model,
        tier=first.tier,
        api_key_id=first.api_key.public_id,
        project_id=first.project.public_id,
        route=_route(prefill, decode),
        started_at=started_at,
        finished_at=finished_at,
        time_to_first_token_ms=milliseconds(prefill.finished_at - prefill.started_at) if prefill else None,
        phases=_phases(prefill, decode, started_at),
        totals=_totals(prefill, decode),
        events=sorted(events, key=lambda event: (event.started_at, event.phase)),
    )


def _route(prefill: UsageEvent | None, decode: UsageEvent | None) -> str:
    if prefill is None:
        return Route.DECODE_ONLY
    if decode is None:
        return Route.PREFILL_ONLY
    return Route.COLOCATED if _colocated(prefill, decode) else Route.SPLIT


def _colocated(prefill: UsageEvent, decode: UsageEvent) -> bool:
    return prefill.worker_id == decode.worker_id and prefill.kv_bytes == 0


def _phases(prefill: UsageEvent | None, decode: UsageEvent | None, origin: datetime) -> list[RequestPhase]:
    if prefill is not None and decode is not None and _colocated(prefill, decode):
        return [_colocated_phase(prefill, decode, origin)]
    phases = []
    if prefill is not None:
        phases.append(_prefill_phase(prefill, origin))
    if prefill is not None and decode is not None:
        handoff_end = max(prefill.finished_at, decode.started_at)
        phases.append(
            RequestPhase(
                kind=PhaseKind.KV_HANDOFF,
                started_at=prefill.finished_at,
                finished_at=handoff_end,
                offset_ms=milliseconds(prefill.finished_at - origin),
                kv_bytes=prefill.kv_bytes,
            )
        )
    if decode is not None:
        phases.append(
            RequestPhase(
                kind=PhaseKind.DECODE,
                started_at=decode.started_at,
                finished_at=decode.finished_at,
                offset_ms=milliseconds(decode.started_at - origin),
                worker_id=decode.worker_id,
                compute_ms=decode.compute_ms,
                output_tokens=decode.tokens,
            )
        )
    return phases


def _prefill_phase(prefill: UsageEvent, origin: datetime) -> RequestPhase:
    return RequestPhase(
        kind=PhaseKind.PREFILL,
        started_at=prefill.started_at,
        finished_at=prefill.finished_at,
        offset_ms=milliseconds(prefill.started_at - origin),
        worker_id=prefill.worker_id,
        compute_ms=prefill.compute_ms,
        queued_ms=_queued_ms(prefill),
        computed_tokens=prefill.tokens - prefill.cached_tokens,
        cached_tokens=prefill.cached_tokens,
    )


def _colocated_phase(prefill: UsageEvent, decode: UsageEvent, origin: datetime) -> RequestPhase:
    return RequestPhase(
        kind=PhaseKind.COLOCATED,
        started_at=prefill.started_at,
        finished_at=max(prefill.finished_at, decode.finished_at),
        offset_ms=milliseconds(prefill.started_at - origin),
        worker_id=prefill.worker_id,
        compute_ms=_colocated_compute_ms(prefill, decode),
        queued_ms=_queued_ms(prefill),
        computed_tokens=prefill.tokens - prefill.cached_tokens,
        cached_tokens=prefill.cached_tokens,
        output_tokens=decode.tokens,
    )


def _colocated_compute_ms(prefill: UsageEvent, decode: UsageEvent) -> int:
    """A colocated worker reports its call's compute so far with the first token (the prefill event's) and the
    whole call's with the last (the decode event's, which so includes the prefill's); a request ended by its
    first token has a decode event of 0."""
    return max(prefill.compute_ms, decode.compute_ms)


def _queued_ms(prefill: UsageEvent) -> float:
    """Wall time to the first token less the worker's compute; never below 0 (clocks of two machines)."""
    return max(0.0, round(milliseconds(prefill.finished_at - prefill.started_at) - prefill.compute_ms, 3))


def _totals(prefill: UsageEvent | None, decode: UsageEvent | None) -> RequestTotals:
    prompt = prefill.tokens if prefill else 0
    cached = prefill.cached_tokens if prefill else 0
    return RequestTotals(
        prompt_tokens=prompt,
        computed_tokens=prompt - cached,
        cached_tokens=cached,
        output_tokens=decode.tokens if decode else 0,
        kv_bytes=prefill.kv_bytes if prefill else 0,
        compute_ms=_compute_ms(prefill, decode),
    )


def _compute_ms(prefill: UsageEvent | None, decode: UsageEvent | None) -> int:
    if prefill is not None and decode is not None and _colocated(prefill, decode):
        return _colocated_compute_ms(prefill, decode)
    return (prefill.compute_ms if prefill else 0) + (decode.compute_ms if decode else 0)
