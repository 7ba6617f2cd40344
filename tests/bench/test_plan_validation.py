"""`python -m bench.plan_validation`: a few requests served by a real split and a real colocated platform
on loopback and simulated on the same trace, every request measured and predicted; and the arithmetic of
the comparison on known figures. No error bound is asserted: the figures are the run's to report."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from bench.plan_validation import (
    FLEETS,
    PROFILES_DIR,
    RequestPair,
    Run,
    compare,
    gateway_routing,
    make_trace,
    metrics,
)
from bench.stats import RequestResult
from diptych_server.cli import _parser as cli_parser
from diptych_server.stack import REPO_ROOT
from planner.profile import load_profile
from planner.simulator import simulate
from planner.types import RequestOutcome, RequestSpec
from planner.workload import Lengths, Workload

RUN_TIMEOUT_S = 400


def test_a_small_trace_is_measured_and_predicted_in_both_modes(tmp_path):
    figures, chart = tmp_path / "validation.json", tmp_path / "validation.png"
    command = [
        sys.executable,
        "-m",
        "bench.plan_validation",
        "--model",
        "diptych-tiny",
        "--rates",
        "4",
        "--requests",
        "4",
        "--prompt-tokens",
        "48-160",
        "--output-tokens",
        "4-12",
        "--json",
        str(figures),
        "--chart",
        str(chart),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = json.loads(figures.read_text())
    assert [(run["mode"], run["rate_per_s"]) for run in runs] == [("split", 4.0), ("colocated", 4.0)]
    split, colocated = runs
    assert split["failed"] == [] and colocated["failed"] == []
    assert len(split["pairs"]) == len(colocated["pairs"]) == 4
    for a, b in zip(split["pairs"], colocated["pairs"], strict=True):  # the same trace in both modes
        assert (a["prompt_tokens"], a["output_tokens"], a["arrival_s"]) == (
            b["prompt_tokens"],
            b["output_tokens"],
            b["arrival_s"],
        )
    for run in runs:
        for pair in run["pairs"]:
            assert 48 <= pair["prompt_tokens"] <= 160 and 4 <= pair["output_tokens"] <= 12
            for field in ("measured_ttft_s", "predicted_ttft_s", "measured_tpot_s", "predicted_tpot_s"):
                assert 0 < pair[field] < 60, (field, pair)
    rows = [line.split()[:3] for line in result.stdout.splitlines() if line.startswith(("split", "colocated"))]
    assert rows == [[mode, "4", "4"] for mode in ("split", "colocated") for _ in range(5)]  # 5 metrics a mode
    assert "largest |error| over the runs: TTFT p50" in result.stdout
    assert chart.stat().st_size > 10_000


def _spec(prompt: int, output: int, arrival: float = 0.0) -> RequestSpec:
    return RequestSpec(arrival, prompt, output)


def _result(sent: float, first: float, gap: float, tokens: int, error: str = "") -> RequestResult:
    return RequestResult(
        sent_at=sent, token_times=[first + i * gap for i in range(tokens)], token_ids=[7] * tokens, error=error
    )


def test_compare_pairs_each_request_and_leaves_out_failed_or_short_ones():
    specs = [_spec(64, 5), _spec(32, 4), _spec(16, 3)]
    results = [
        _result(0.0, 0.2, 0.05, 5),
        _result(0.0, 0.1, 0.05, 2),  # two tokens of four: cut short
        RequestResult(sent_at=0.0, error="UNAVAILABLE: gone"),
    ]
    predicted = [RequestOutcome(spec, 0.25, 0.04) for spec in specs]
    run = compare("split", 2.0, specs, results, predicted, load_average=0.5)
    assert len(run.pairs) == 1 and len(run.failed) == 2
    pair = run.pairs[0]
    assert pair.measured_ttft_s == pytest.approx(0.2) and pair.measured_tpot_s == pytest.approx(0.05)
    assert (pair.predicted_ttft_s, pair.predicted_tpot_s) == (0.25, 0.04)
    assert pair.measured_second_token_s == pytest.approx(0.05) and run.load_average == 0.5
    assert "UNAVAILABLE: gone" in run.failed and "2 of 4 tokens" in run.failed


def test_metrics_give_percentiles_and_the_relative_error():
    pairs = [RequestPair(64, 8, 0.0, 0.1 * i, 0.02, 0.2 * i, 0.03, 0.02) for i in range(1, 6)]
    pairs.append(RequestPair(64, 1, 0.0, 0.3, 0.0, 0.6, 0.0, 0.0))  # one token: in TTFT, not in TPOT
    by_name = {m.name: m for m in metrics(Run("colocated", 1.0, pairs, [], 0.0))}
    assert by_name["TTFT p50"].measured_s == pytest.approx(0.3)
    assert by_name["TTFT p50"].error == pytest.approx(1.0)
    assert by_name["TPOT mean"].measured_s == pytest.approx(0.02) and by_name["TPOT mean"].error == pytest.approx(0.5)
    assert by_name["TPOT p90"].predicted_s == pytest.approx(0.03)
    assert math.isnan(metrics(Run("split", 1.0, [], [], 0.0))[0].error)


def test_the_trace_is_the_workloads_and_the_simulated_routing_is_the_gateways():
    workload = Workload(2.0, Lengths(16, 64), Lengths(4, 8), requests=6, seed=3)
    specs, sent = make_trace(workload, vocab_size=512)
    assert specs == workload.sample()
    assert [len(r.prompt_token_ids) for r in sent] == [s.prompt_tokens for s in specs]
    assert [(r.output_tokens, r.arrival_s) for r in sent] == [(s.output_tokens, s.arrival_s) for s in specs]
    assert make_trace(workload, vocab_size=512)[1] == sent
    defaults = cli_parser().parse_args(["gateway"])
    routing = gateway_routing()
    assert (routing.skip_split_below, routing.prefill_overflow_tokens) == (
        defaults.skip_split_below,
        defaults.prefill_overflow_tokens,
    )


def test_the_simulator_adds_a_split_fleets_own_ttft_overhead_where_the_profile_measured_one():
    shipped = load_profile(PROFILES_DIR / "cpu-diptych-tiny.json")
    profile = dataclasses.replace(shipped, ttft_overhead_s=0.004, split_ttft_overhead_s=None)
    trace = [RequestSpec(0.0, 64, 4), RequestSpec(5.0, 128, 4)]
    split, colocated = FLEETS["split"], FLEETS["colocated"]
    common = [o.ttft_s for o in simulate(profile, trace, split)]
    own = [o.ttft_s for o in simulate(dataclasses.replace(profile, split_ttft_overhead_s=0.050), trace, split)]
    assert own == pytest.approx([t + 0.046 for t in common])
    before = [o.ttft_s for o in simulate(profile, trace, colocated)]
    after = [o.ttft_s for o in simulate(dataclasses.replace(profile, split_ttft_overhead_s=0.050), trace, colocated)]
    assert after == before
