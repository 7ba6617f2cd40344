"""What the chaos run's clients saw against what the usage ledger billed, request id by request id.

The clients know, per request, the server-issued request id, the organization whose key sent it and the
tokens that reached them; the ledger holds one event per (request id, phase). `reconcile` compares the
two without any knowledge of how the platform got there, so it judges the platform, not the other way.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass, field

PREFILL, DECODE = "prefill", "decode"


@dataclass
class RequestRecord:
    """One request as its client saw it."""

    organization_id: str
    prompt_tokens: int  # what the client sent
    sent_at_s: float  # seconds since the load started
    request_id: str = ""  # from the first message, or the error's `request-id` metadata
    delivered_tokens: int = 0  # token ids that reached the client, an error's included
    completed: bool = False  # the stream ended with a finish reason
    error: str = ""  # the gRPC status code's name when it did not
    usage_completion_tokens: int | None = None  # what the last message's usage said, when it came
    ended_at_s: float = 0.0  # seconds since the load started, when the stream ended or failed
    interrupted: bool = False  # cut mid-way, and resumed with what its execution had handed over


@dataclass(frozen=True)
class LedgerEvent:
    request_id: str
    phase: str
    organization_id: str
    tokens: int
    api_key_id: str = ""  # the public id of the key it is billed to
    tier: str = "standard"
    client_request_id: str = ""  # the client's label for the request, if it gave one


@dataclass
class Reconciliation:
    requests_sent: int = 0
    completed: int = 0
    errored: int = 0
    errored_before_any_token: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    resumed: int = 0  # streams cut mid-way whose clients fetched what their execution had handed over
    delivered_tokens: int = 0
    ledger_events: int = 0
    billed_input_tokens: int = 0
    billed_output_tokens: int = 0
    # lost: delivered tokens with no decode event or a smaller one, or a prompt that produced tokens
    # with no prefill event
    lost: int = 0
    lost_output_tokens: int = 0
    missing_prefill: int = 0
    # doubled: more than one event for a (request id, phase), or one request id given to two requests
    doubled: int = 0
    shared_request_ids: int = 0
    # overbilled: a decode event for more tokens than reached the client; {extra tokens: requests}, and
    # each such request by id with what it was billed and what its client received
    overbilled: int = 0
    overbilled_distribution: dict[int, int] = field(default_factory=dict)
    overbilled_requests: list[dict] = field(default_factory=list)
    prefill_tokens_mismatch: int = 0  # a prefill event that does not bill the prompt the client sent
    usage_mismatch: int = 0  # a completed stream whose usage disagrees with the tokens received
    misattributed: int = 0  # events billed to another organization than the client's
    unknown_events: int = 0  # events whose request id no client saw
    unknown_output_tokens: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.doubled or self.misattributed or self.overbilled)


def reconcile(records: list[RequestRecord], events: list[LedgerEvent]) -> Reconciliation:
    result = Reconciliation(requests_sent=len(records), ledger_events=len(events))
    _count_client_side(records, result)
    billed = _index_events(events, result)
    by_id = _index_records(records, result)
    for request_id, record in by_id.items():
        _compare(record, billed.pop(request_id, {}), result)
    for phases in billed.values():
        result.unknown_events += len(phases)
        result.unknown_output_tokens += phases[DECODE].tokens if DECODE in phases else 0
    return result


def _count_client_side(records: list[RequestRecord], result: Reconciliation) -> None:
    errors = Counter(r.error for r in records if not r.completed)
    result.completed = sum(r.completed for r in records)
    result.resumed = sum(r.interrupted for r in records)
    result.errored = result.requests_sent - result.completed
    result.errored_before_any_token = sum(not r.completed and r.delivered_tokens == 0 for r in records)
    result.errors_by_code = dict(errors.most_common())
    result.delivered_tokens = sum(r.delivered_tokens for r in records)
    result.usage_mismatch = sum(r.completed and r.usage_completion_tokens != r.delivered_tokens for r in records)


def _index_events(events: list[LedgerEvent], result: Reconciliation) -> dict[str, dict[str, LedgerEvent]]:
    billed: dict[str, dict[str, LedgerEvent]] = defaultdict(dict)
    for event in events:
        if event.phase in billed[event.request_id]:
            result.doubled += 1
        billed[event.request_id][event.phase] = event
        if event.phase == DECODE:
            result.billed_output_tokens += event.tokens
        else:
            result.billed_input_tokens += event.tokens
    return billed


def _index_records(records: list[RequestRecord], result: Reconciliation) -> dict[str, RequestRecord]:
    by_id: dict[str, RequestRecord] = {}
    for record in records:
        if not record.request_id:
            continue
        if record.request_id in by_id:
            result.shared_request_ids += 1
            result.doubled += 1
        by_id[record.request_id] = record
    return by_id


def _compare(record: RequestRecord, phases: dict[str, LedgerEvent], result: Reconciliation) -> None:
    result.misattributed += sum(e.organization_id != record.organization_id for e in phases.values())
    if PREFILL in phases and phases[PREFILL].tokens != record.prompt_tokens:
        result.prefill_tokens_mismatch += 1
    billed_output = phases[DECODE].tokens if DECODE in phases else 0
    if record.delivered_tokens == 0 and not phases:
        return
    if billed_output > record.delivered_tokens:
        extra = billed_output - record.delivered_tokens
        result.overbilled += 1
        result.overbilled_distribution[extra] = result.overbilled_distribution.get(extra, 0) + 1
        result.overbilled_requests.append(
            {
                "request_id": record.request_id,
                "billed": billed_output,
                "delivered": record.delivered_tokens,
                "error": record.error,
                "sent_at_s": round(record.sent_at_s, 2),
                "ended_at_s": round(record.ended_at_s, 2),
            }
        )
    missing_prefill = record.delivered_tokens > 0 and PREFILL not in phases
    result.missing_prefill += missing_prefill
    if billed_output < record.delivered_tokens or missing_prefill:
        result.lost += 1
        result.lost_output_tokens += max(0, record.delivered_tokens - billed_output)
