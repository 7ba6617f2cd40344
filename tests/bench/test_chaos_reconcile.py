"""The chaos run's verdict (`bench.chaos.ledger.reconcile`) on hand-made clients' records and ledgers: each
way of billing wrongly is caught, and counted where it belongs."""

import pytest

from bench.chaos.ledger import LedgerEvent, RequestRecord, reconcile
from bench.chaos.options import parse_args
from bench.chaos.report import ChaosReport, render

ORG_A, ORG_B = "org_a", "org_b"


def _record(
    request_id: str,
    delivered: int,
    *,
    organization: str = ORG_A,
    prompt: int = 10,
    completed: bool = True,
    error: str = "",
) -> RequestRecord:
    return RequestRecord(
        organization, prompt, 0.0, request_id, delivered, completed, error, delivered if completed else None
    )


def _billed(request_id: str, output: int, *, organization: str = ORG_A, prompt: int = 10) -> list[LedgerEvent]:
    return [
        LedgerEvent(request_id, "prefill", organization, prompt),
        LedgerEvent(request_id, "decode", organization, output),
    ]


def test_every_delivered_token_billed_once_passes():
    records = [
        _record("r1", 5),
        _record("r2", 3, organization=ORG_B),
        _record("", 0, completed=False, error="UNAVAILABLE"),
    ]
    result = reconcile(records, _billed("r1", 5) + _billed("r2", 3, organization=ORG_B))
    assert (result.requests_sent, result.completed, result.errored, result.errored_before_any_token) == (3, 2, 1, 1)
    assert (result.delivered_tokens, result.billed_output_tokens, result.billed_input_tokens) == (8, 8, 20)
    assert (result.lost, result.doubled, result.misattributed) == (0, 0, 0)
    assert (result.overbilled, result.unknown_events) == (0, 0)
    assert result.errors_by_code == {"UNAVAILABLE": 1}
    assert not result.failed


def test_delivered_tokens_without_a_decode_event_are_lost():
    result = reconcile([_record("r1", 4, completed=False, error="UNAVAILABLE")], [])
    assert (result.lost, result.lost_output_tokens, result.missing_prefill) == (1, 4, 1)
    assert result.failed


def test_a_decode_event_short_of_the_delivered_tokens_is_lost():
    result = reconcile([_record("r1", 6)], _billed("r1", 4))
    assert (result.lost, result.lost_output_tokens, result.missing_prefill) == (1, 2, 0)
    assert result.failed


def test_a_missing_prefill_event_is_lost_even_when_decode_is_billed():
    result = reconcile([_record("r1", 6)], [LedgerEvent("r1", "decode", ORG_A, 6)])
    assert (result.lost, result.lost_output_tokens, result.missing_prefill) == (1, 0, 1)


def test_billing_more_than_delivered_is_overbilled_fails_the_run_and_names_each_request():
    records = [
        _record("r1", 2, completed=False, error="UNAVAILABLE"),
        _record("r2", 0, completed=False, error="UNAVAILABLE"),
        _record("r3", 7, completed=False, error="CANCELLED"),
    ]
    result = reconcile(records, _billed("r1", 3) + _billed("r2", 1) + _billed("r3", 9))
    assert result.overbilled == 3
    assert result.overbilled_distribution == {1: 2, 2: 1}
    assert result.lost == 0 and result.failed
    named = {r["request_id"]: (r["billed"], r["delivered"], r["error"]) for r in result.overbilled_requests}
    assert named == {"r1": (3, 2, "UNAVAILABLE"), "r2": (1, 0, "UNAVAILABLE"), "r3": (9, 7, "CANCELLED")}


def test_two_events_for_one_request_and_phase_are_doubled():
    result = reconcile([_record("r1", 5)], [*_billed("r1", 5), LedgerEvent("r1", "decode", ORG_A, 5)])
    assert result.doubled == 1 and result.failed


def test_one_request_id_returned_to_two_requests_is_doubled():
    result = reconcile([_record("r1", 5), _record("r1", 5)], _billed("r1", 5))
    assert (result.doubled, result.shared_request_ids) == (1, 1) and result.failed


def test_events_billed_to_another_organization_are_misattributed():
    result = reconcile([_record("r1", 5, organization=ORG_B)], _billed("r1", 5, organization=ORG_A))
    assert result.misattributed == 2 and result.failed


def test_events_no_client_saw_are_unknown_and_do_not_fail_the_run():
    result = reconcile([_record("r1", 5)], _billed("r1", 5) + _billed("ghost", 3))
    assert (result.unknown_events, result.unknown_output_tokens) == (2, 3)
    assert not result.failed


def test_prefill_not_billing_the_prompt_and_usage_disagreeing_are_reported():
    record = _record("r1", 5, prompt=12)
    record.usage_completion_tokens = 4
    result = reconcile([record], _billed("r1", 5, prompt=10))
    assert (result.prefill_tokens_mismatch, result.usage_mismatch) == (1, 1)


def test_a_request_that_produced_nothing_and_was_billed_nothing_is_fine():
    result = reconcile([_record("r1", 0, completed=False, error="DEADLINE_EXCEEDED")], [])
    assert (result.lost, result.overbilled, result.missing_prefill) == (0, 0, 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kill-interval", "5", "2"], "--kill-interval takes MIN MAX with 0 <= MIN <= MAX, not 5.0 2.0"),
        (["--down-time", "-1", "2"], "--down-time takes MIN MAX with 0 <= MIN <= MAX"),
        (["--max-tokens", "0", "4"], "--max-tokens, --batch-lines and --batch-max-tokens need MIN of at least 1"),
        (["--batch-lines", "0", "4"], "--max-tokens, --batch-lines and --batch-max-tokens need MIN of at least 1"),
        (["--cancel-share", "1.5"], "--cancel-share must be between 0 and 1, not 1.5"),
        (["--duration", "0"], "--duration must be positive, not 0.0"),
        (["--max-kills", "-1"], "--max-kills must be 0 or more, not -1"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_change(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_table_names_every_figure_the_run_is_judged_on():
    ledger = reconcile([_record("r1", 2, completed=False, error="UNAVAILABLE")], _billed("r1", 3))
    kills = {"prefill": 0, "decode": 0, "gateway": 1, "control-plane": 0}
    report = ChaosReport(10.0, 12.5, 1, kills, [], [], {}, True, 0, ledger)
    text = render(report)
    for figure in (
        "requests sent",
        "completed",
        "delivered tokens",
        "ledger events",
        "billed output tokens",
        "**lost**",
        "**doubled**",
        "**overbilled**",
        "**misattributed**",
        "kills per victim kind",
    ):
        assert f"| {figure}" in text
    assert "| overbilled by (extra tokens: requests) | +1: 1 |" in text
    assert "gateway 1" in text
    assert "- r1: billed 3, received 2, UNAVAILABLE" in text
    assert "Verdict: FAILED" in text
