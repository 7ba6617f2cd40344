"""What a chaos run's batches report (their output and error files) against what the usage ledger billed,
line by line (`bench.chaos.batch_files` collects the files, `bench.chaos.database` reads the ledger).

A line is identified by its custom_id, unique in the run. The files report, per custom_id, an answer (the
output file: status 200 and the execution's server-issued id), a refusal (the error file, with the
gateway's answer) or that it never ran (the error file without a response). The ledger holds one event per
(execution id, phase), billed to an organization, an API key and a tier, and labelled with the line's
custom_id (the line's `user`, which the gateway keeps as the client's label). A line's billed executions
are those labelled with its custom_id and the one its answer names. `reconcile_batches` then counts:

- lost: a line answered in the output file whose execution has no prefill event, no decode event, or a
  decode event for fewer tokens than its answer's `completion_tokens`;
- doubled: a line billed for more than one execution, an execution billed twice in a phase, or one
  execution id reported for two lines;
- misattributed: a line with an event billed to another organization than the batch's, another key than
  the batch's runner key, or a tier other than `batch`;
- billed but not reported: a line billed although its files report it refused or never run, or although
  it is in neither file; and an execution billed to a runner key that no line names (these are counted
  as executions, `unclaimed_executions`);
- unended: a batch still running when the run gave up waiting.

Like `bench.chaos.ledger`, it knows nothing of how the platform got there.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from bench.chaos.ledger import DECODE, PREFILL, LedgerEvent

BATCH_TIER = "batch"
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass(frozen=True)
class ReportedLine:
    """One record of a batch's output or error file."""

    custom_id: str
    file: str  # "output" or "error"
    status_code: int | None  # the gateway's answer; None for a line reported as never run
    request_id: str = ""  # the execution's id, when there was an answer
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error_code: str = ""  # for a line without an answer: batch_cancelled, batch_expired, gateway_unavailable


@dataclass
class BatchRecord:
    """One batch as the control plane's Batch API reports it after the run."""

    batch_id: str
    organization_id: str
    runner_key_id: str  # the public id of the key its lines were sent with
    status: str
    custom_ids: list[str]  # its input file's, in order
    reported: list[ReportedLine]  # its output file's records, then its error file's
    request_counts: dict = field(default_factory=dict)


@dataclass
class BatchReconciliation:
    batches: int = 0
    batches_by_status: dict[str, int] = field(default_factory=dict)
    lines: int = 0
    answered: int = 0  # in the output file
    refused: int = 0  # in the error file with the gateway's answer
    not_run: dict[str, int] = field(default_factory=dict)  # in the error file without an answer, by error code
    ledger_events: int = 0  # those of batch lines and runner keys
    billed_executions: int = 0
    billed_input_tokens: int = 0
    billed_output_tokens: int = 0
    lost: int = 0
    doubled: int = 0
    misattributed: int = 0
    billed_not_reported: int = 0
    unclaimed_executions: int = 0  # billed to a runner key, named by no line (counted in billed_not_reported)
    absent: int = 0  # custom_ids of an input file in neither result file
    reported_twice: int = 0  # custom_ids in both files, or twice in one
    counts_disagree: int = 0  # batches whose request_counts disagree with their files
    overbilled: int = 0  # answered lines billed for more output tokens than their answer says (reported only)
    unended: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.doubled or self.misattributed or self.billed_not_reported or self.unended)


def reconcile_batches(batches: list[BatchRecord], events: list[LedgerEvent]) -> tuple[BatchReconciliation, set[str]]:
    """The figures, and the execution ids they account for (the other events are interactive traffic's)."""
    result = BatchReconciliation(batches=len(batches))
    claimed: set[str] = set()
    result.batches_by_status = dict(Counter(b.status for b in batches).most_common())
    result.unended = sum(b.status not in TERMINAL for b in batches)
    by_request: dict[str, list[LedgerEvent]] = defaultdict(list)
    by_label: dict[str, set[str]] = defaultdict(set)
    for event in events:
        by_request[event.request_id].append(event)
        if event.client_request_id:
            by_label[event.client_request_id].add(event.request_id)
    reported_ids: Counter = Counter()
    for batch in batches:
        claimed |= _check_batch(batch, by_request, by_label, reported_ids, result)
    result.doubled += sum(n - 1 for request_id, n in reported_ids.items() if request_id and n > 1)
    runner_keys = {b.runner_key_id for b in batches if b.runner_key_id}
    unclaimed = {e.request_id for e in events if e.api_key_id in runner_keys and e.request_id not in claimed}
    result.unclaimed_executions = len(unclaimed)
    result.billed_not_reported += len(unclaimed)
    claimed |= unclaimed
    billed = [e for request_id in claimed for e in by_request.get(request_id, [])]
    result.ledger_events = len(billed)
    result.billed_executions = len({e.request_id for e in billed})
    result.billed_input_tokens = sum(e.tokens for e in billed if e.phase == PREFILL)
    result.billed_output_tokens = sum(e.tokens for e in billed if e.phase == DECODE)
    return result, claimed


def _check_batch(
    batch: BatchRecord,
    by_request: dict[str, list[LedgerEvent]],
    by_label: dict[str, set[str]],
    reported_ids: Counter,
    result: BatchReconciliation,
) -> set[str]:
    """Checks the batch's lines; returns the executions billed for them."""
    claimed: set[str] = set()
    result.lines += len(batch.custom_ids)
    reports: dict[str, list[ReportedLine]] = defaultdict(list)
    for line in batch.reported:
        reports[line.custom_id].append(line)
    answered = sum(r.file == "output" for r in batch.reported)
    failed = sum(r.file == "error" for r in batch.reported)
    counts = batch.request_counts
    if counts and (counts.get("completed") != answered or counts.get("failed") != failed):
        result.counts_disagree += 1
    for custom_id in batch.custom_ids:
        found = reports.pop(custom_id, [])
        result.reported_twice += len(found) > 1
        report = found[0] if found else None
        executions = set(by_label.get(custom_id, ()))
        if report is not None and report.request_id and report.request_id in by_request:
            executions.add(report.request_id)
        if report is not None and report.request_id:
            reported_ids[report.request_id] += 1
        claimed |= executions
        line_events = [e for request_id in executions for e in by_request[request_id]]
        if any(_misattributed(e, batch) for e in line_events):
            result.misattributed += 1
        if any(n > 1 for n in Counter((e.request_id, e.phase) for e in line_events).values()):
            result.doubled += 1
        _check_outcome(report, executions, by_request, result)
    result.reported_twice += sum(len(found) for found in reports.values())  # custom_ids of no input line
    return claimed


def _check_outcome(
    report: ReportedLine | None,
    executions: set[str],
    by_request: dict[str, list[LedgerEvent]],
    result: BatchReconciliation,
) -> None:
    """Counts how the line was reported: absent, answered (and billed as answered), not run or refused."""
    if report is None:
        result.absent += 1
        result.billed_not_reported += bool(executions)
    elif report.file == "output" and report.status_code == 200:
        result.answered += 1
        _check_answered(report, executions, by_request, result)
    else:
        if report.status_code is None:
            result.not_run[report.error_code] = result.not_run.get(report.error_code, 0) + 1
        else:
            result.refused += 1
        result.billed_not_reported += bool(executions)


def _check_answered(
    report: ReportedLine, executions: set[str], by_request: dict[str, list[LedgerEvent]], result: BatchReconciliation
) -> None:
    phases = {e.phase: e for e in by_request.get(report.request_id, [])}
    decode = phases[DECODE].tokens if DECODE in phases else 0
    expected = report.completion_tokens or 0
    if PREFILL not in phases or DECODE not in phases or decode < expected:
        result.lost += 1
    elif decode > expected:
        result.overbilled += 1
    if executions - {report.request_id}:
        result.doubled += 1


def _misattributed(event: LedgerEvent, batch: BatchRecord) -> bool:
    return (
        event.organization_id != batch.organization_id
        or event.api_key_id != batch.runner_key_id
        or event.tier != BATCH_TIER
    )
