"""The chaos run's result: what the clients received set against the ledger (`bench.chaos.ledger`) and the
batches' files against it (`bench.chaos.batch_ledger`), with the kills and errors beside them, as a
Markdown table and a verdict."""

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from bench.chaos.batch_ledger import BatchReconciliation, BatchRecord, reconcile_batches
from bench.chaos.batch_load import BatchTraffic
from bench.chaos.faults import Chaos
from bench.chaos.ledger import LedgerEvent, Reconciliation, reconcile
from bench.chaos.load import Load

TOP_ERROR_MESSAGES = 6


@dataclass
class ChaosReport:
    duration_s: float
    load_s: float
    organizations: int
    kills: dict[str, int]
    timeline: list[dict]
    exited_by_themselves: list[str]
    error_messages: dict[str, int]  # the most frequent "CODE: details" the clients got
    drained: bool
    completed_after_last_restart: int | None
    ledger: Reconciliation
    batches: BatchReconciliation | None = None
    batches_submitted: int = 0  # create calls that were answered or retried (a lost answer may still create one)
    batches_cancelled: dict[str, int] = field(default_factory=dict)  # the cancel call's outcome -> batches
    batch_calls_retried: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.ledger.failed or (self.batches is not None and self.batches.failed)


def build_report(
    args,
    load: Load,
    chaos: Chaos,
    drained: bool,
    events: list[LedgerEvent],
    traffic: BatchTraffic | None = None,
    batches: list[BatchRecord] | None = None,
) -> ChaosReport:
    batch_ledger, batch_ids = reconcile_batches(batches, events) if batches is not None else (None, set())
    interactive_events = [e for e in events if e.request_id not in batch_ids]
    last_back = max((k.back_at_s for k in chaos.kills), default=None)
    after = None if last_back is None else sum(r.completed and r.sent_at_s >= last_back for r in load.records)
    return ChaosReport(
        duration_s=args.duration,
        load_s=round(load.seconds, 1),
        organizations=len({r.organization_id for r in load.records}),
        kills=chaos.kills_by_kind(),
        timeline=[dataclasses.asdict(k) for k in chaos.kills],
        exited_by_themselves=chaos.exited_by_themselves,
        error_messages=dict(load.error_messages.most_common(TOP_ERROR_MESSAGES)),
        drained=drained,
        completed_after_last_restart=after,
        ledger=reconcile(load.records, interactive_events),
        batches=batch_ledger,
        batches_submitted=len(traffic.submitted) if traffic else 0,
        batches_cancelled=dict(Counter(b.cancel.split(":")[0] for b in traffic.submitted if b.cancel))
        if traffic
        else {},
        batch_calls_retried=dict(traffic.retried_calls) if traffic else {},
    )


def render(report: ChaosReport) -> str:
    ledger = report.ledger
    rows = [
        ("requests sent", ledger.requests_sent),
        ("completed", ledger.completed),
        ("errored (before any token)", f"{ledger.errored} ({ledger.errored_before_any_token})"),
        ("streams cut mid-way and resumed (finish reason interrupted)", ledger.resumed),
        ("errors by code", ", ".join(f"{code} {n}" for code, n in ledger.errors_by_code.items()) or "none"),
        ("delivered tokens", ledger.delivered_tokens),
        ("ledger events", ledger.ledger_events),
        ("billed input tokens", ledger.billed_input_tokens),
        ("billed output tokens", ledger.billed_output_tokens),
        (
            "**lost** (output tokens; missing prefill)",
            f"{ledger.lost} ({ledger.lost_output_tokens}; {ledger.missing_prefill})",
        ),
        ("**doubled** (request ids shared)", f"{ledger.doubled} ({ledger.shared_request_ids})"),
        ("**overbilled**", ledger.overbilled),
        (
            "overbilled by (extra tokens: requests)",
            ", ".join(f"+{extra}: {n}" for extra, n in sorted(ledger.overbilled_distribution.items())) or "none",
        ),
        ("**misattributed**", ledger.misattributed),
        ("unknown events (their output tokens)", f"{ledger.unknown_events} ({ledger.unknown_output_tokens})"),
        ("prefill events not billing the prompt sent", ledger.prefill_tokens_mismatch),
        ("completed streams whose usage disagrees", ledger.usage_mismatch),
        ("kills per victim kind", ", ".join(f"{kind} {n}" for kind, n in report.kills.items())),
        ("processes that exited by themselves", ", ".join(report.exited_by_themselves) or "none"),
        ("requests completed after the last restart", report.completed_after_last_restart),
        ("usage drained before the ledger was read", "yes" if report.drained else "**no**"),
    ]
    title = (
        f"## Chaos run: {report.load_s:g} s of load ({report.duration_s:g} s of kills) from "
        f"{report.organizations} organizations"
    )
    lines = [title, "", "| figure | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    if report.batches is not None:
        lines += ["", "Batch API traffic:", "", "| figure | value |", "| --- | --- |"]
        lines += [f"| {name} | {value} |" for name, value in _batch_rows(report)]
    if ledger.overbilled_requests:
        lines += ["", "Overbilled requests (output tokens billed, received by the client):", ""]
        lines += [
            f"- {r['request_id'] or '(no request id)'}: billed {r['billed']}, received {r['delivered']}"
            f"{', ' + r['error'] if r['error'] else ''}; sent at {r['sent_at_s']:g} s, ended at {r['ended_at_s']:g} s"
            for r in ledger.overbilled_requests
        ]
    if report.failed:
        verdict = "FAILED: usage lost, doubled, overbilled, misattributed or billed but not reported"
    else:
        verdict = "every delivered token billed once"
        verdict += "" if report.batches is None else ", every answered batch line billed once and no other"
    return "\n".join([*lines, "", f"Verdict: {verdict}."])


def _batch_rows(report: ChaosReport) -> list[tuple[str, object]]:
    batches = report.batches
    assert batches is not None
    not_run = ", ".join(f"{code} {n}" for code, n in sorted(batches.not_run.items())) or "none"
    return [
        ("batches submitted / on the control plane", f"{report.batches_submitted} / {batches.batches}"),
        ("batches by status", ", ".join(f"{status} {n}" for status, n in batches.batches_by_status.items()) or "none"),
        (
            "cancel calls (the batch's status after)",
            ", ".join(f"{s} {n}" for s, n in report.batches_cancelled.items()) or "none",
        ),
        ("Batch API calls retried", ", ".join(f"{c} x{n}" for c, n in report.batch_calls_retried.items()) or "none"),
        ("lines", batches.lines),
        ("answered (output file)", batches.answered),
        ("refused (error file, with an answer)", batches.refused),
        ("not run (error file, by code)", not_run),
        ("billed executions (ledger events)", f"{batches.billed_executions} ({batches.ledger_events})"),
        ("billed input / output tokens", f"{batches.billed_input_tokens} / {batches.billed_output_tokens}"),
        ("**lost**", batches.lost),
        ("**doubled**", batches.doubled),
        ("**misattributed** (organization, key or tier)", batches.misattributed),
        (
            "**billed but not reported** (executions no line names)",
            f"{batches.billed_not_reported} ({batches.unclaimed_executions})",
        ),
        ("**batches not ended**", batches.unended),
        ("lines in neither file; reported twice", f"{batches.absent}; {batches.reported_twice}"),
        ("batches whose request_counts disagree with their files", batches.counts_disagree),
        ("answered lines billed more output than answered", batches.overbilled),
    ]
