"""The chaos run's batch verdict (`bench.chaos.batch_ledger.reconcile_batches`) on hand-made batch files and
ledgers: each way of billing a batch line wrongly is caught and counted where it belongs, and the executions
it accounts for are kept out of the interactive reconciliation."""

from bench.chaos.batch_ledger import BatchRecord, ReportedLine, reconcile_batches
from bench.chaos.ledger import LedgerEvent, reconcile
from bench.chaos.report import ChaosReport, render

ORG_A, ORG_B = "org_a", "org_b"
RUNNER, OTHER_RUNNER, INTERACTIVE_KEY = "key_runner", "key_other_runner", "key_a"


def _batch(*reported: ReportedLine, custom_ids: tuple[str, ...] = ("b1-0", "b1-1"), status: str = "completed"):
    return BatchRecord("batch_1", ORG_A, RUNNER, status, list(custom_ids), list(reported))


def _answered(custom_id: str, request_id: str, completion: int = 5) -> ReportedLine:
    return ReportedLine(custom_id, "output", 200, request_id, 10, completion)


def _not_run(custom_id: str, code: str = "batch_cancelled") -> ReportedLine:
    return ReportedLine(custom_id, "error", None, error_code=code)


def _billed(
    request_id: str,
    label: str,
    output: int = 5,
    *,
    organization: str = ORG_A,
    key: str = RUNNER,
    tier: str = "batch",
) -> list[LedgerEvent]:
    return [
        LedgerEvent(request_id, "prefill", organization, 10, key, tier, label),
        LedgerEvent(request_id, "decode", organization, output, key, tier, label),
    ]


def test_answered_lines_billed_once_and_unrun_lines_billed_nothing_pass():
    batch = _batch(_answered("b1-0", "e1"), _not_run("b1-1"))
    interactive = [LedgerEvent("i1", "prefill", ORG_A, 4, INTERACTIVE_KEY), LedgerEvent("i1", "decode", ORG_A, 3)]
    result, claimed = reconcile_batches([batch], _billed("e1", "b1-0") + interactive)
    assert (result.batches, result.lines, result.answered, result.refused) == (1, 2, 1, 0)
    assert result.not_run == {"batch_cancelled": 1}
    assert (result.billed_executions, result.ledger_events, result.billed_output_tokens) == (1, 2, 5)
    assert (result.lost, result.doubled, result.misattributed, result.billed_not_reported) == (0, 0, 0, 0)
    assert claimed == {"e1"} and not result.failed


def test_an_answered_line_with_no_event_or_a_short_one_is_lost():
    batch = _batch(_answered("b1-0", "e1"), _answered("b1-1", "e2", completion=6))
    result, _ = reconcile_batches([batch], _billed("e2", "b1-1", output=4))
    assert result.lost == 2 and result.failed


def test_a_line_billed_for_a_second_execution_is_doubled():
    batch = _batch(_answered("b1-0", "e1"), _answered("b1-1", "e2"))
    result, claimed = reconcile_batches([batch], _billed("e1", "b1-0") + _billed("e2", "b1-1") + _billed("e3", "b1-1"))
    assert (result.doubled, result.billed_not_reported, result.billed_executions) == (1, 0, 3)
    assert claimed == {"e1", "e2", "e3"} and result.failed


def test_one_execution_reported_for_two_lines_is_doubled():
    batch = _batch(_answered("b1-0", "e1"), _answered("b1-1", "e1"))
    result, _ = reconcile_batches([batch], _billed("e1", "b1-0"))
    assert result.doubled == 1 and result.failed


def test_a_line_billed_to_another_organization_key_or_tier_is_misattributed():
    batch = _batch(
        _answered("b1-0", "e1"), _answered("b1-1", "e2"), _answered("b1-2", "e3"), custom_ids=("b1-0", "b1-1", "b1-2")
    )
    events = (
        _billed("e1", "b1-0", organization=ORG_B)
        + _billed("e2", "b1-1", key=OTHER_RUNNER)
        + _billed("e3", "b1-2", tier="standard")
    )
    result, _ = reconcile_batches([batch], events)
    assert (result.misattributed, result.lost) == (3, 0) and result.failed


def test_a_line_reported_as_not_run_or_refused_or_absent_but_billed_is_billed_but_not_reported():
    refused = ReportedLine("b1-1", "error", 400, "e2")
    batch = _batch(_not_run("b1-0"), refused, custom_ids=("b1-0", "b1-1", "b1-2"))
    events = _billed("e1", "b1-0") + _billed("e2", "b1-1") + _billed("e3", "b1-2")
    result, _ = reconcile_batches([batch], events)
    assert (result.billed_not_reported, result.refused, result.absent) == (3, 1, 1) and result.failed


def test_an_execution_of_a_runner_key_that_no_line_names_is_billed_but_not_reported():
    batch = _batch(_answered("b1-0", "e1"), _not_run("b1-1"))
    result, claimed = reconcile_batches([batch], _billed("e1", "b1-0") + _billed("e9", ""))
    assert (result.billed_not_reported, result.unclaimed_executions) == (1, 1)
    assert claimed == {"e1", "e9"} and result.failed


def test_a_batch_still_running_fails_the_run_and_counts_disagreeing_with_files_are_reported():
    batch = _batch(_answered("b1-0", "e1"), _not_run("b1-1"), status="in_progress")
    batch.request_counts = {"total": 2, "completed": 2, "failed": 0}
    result, _ = reconcile_batches([batch], _billed("e1", "b1-0"))
    assert (result.unended, result.counts_disagree) == (1, 1) and result.failed


def test_the_table_names_the_batch_figures_and_the_verdict_follows_them():
    batch = _batch(_answered("b1-0", "e1"), _not_run("b1-1"))
    batches, _ = reconcile_batches([batch], _billed("e1", "b1-0") + _billed("e2", "b1-1"))
    kills = {"prefill": 0, "decode": 0, "gateway": 0, "control-plane": 0, "jobs": 1}
    report = ChaosReport(10.0, 12.5, 1, kills, [], [], {}, True, 0, reconcile([], []), batches, 1, {"cancelling": 1})
    text = render(report)
    for figure in ("Batch API traffic", "lines", "answered (output file)", "**lost**", "**billed but not reported**"):
        assert figure in text
    assert "| **billed but not reported** (executions no line names) | 1 (0) |" in text
    assert "Verdict: FAILED" in text and report.failed
    report.batches, _ = reconcile_batches([batch], _billed("e1", "b1-0"))
    assert "Verdict: every delivered token billed once, every answered batch line billed once" in render(report)
    assert not report.failed
