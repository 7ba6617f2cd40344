"""The benchmark's arithmetic and workload generator on known data, and `generate`'s static batch on the
tiny model: cheap checks that the figures the benchmark prints mean what they say."""

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.baseline import StaticBatchGenerate
from bench.report import BenchReport, GreedyCheck, PrefixEffect, render_report
from bench.stats import RequestResult, Slo, percentile, summarize
from bench.workload import (
    FIRST_ORDINARY_TOKEN,
    BenchRequest,
    WorkloadSpec,
    make_requests,
    poisson_arrivals,
    shared_prefix_prompts,
    with_arrivals,
)
from diptych_common.builtin import DIPTYCH_TINY

SPEC = WorkloadSpec(
    requests=200,
    prompt_tokens_mean=64,
    prompt_tokens_min=8,
    prompt_tokens_max=256,
    output_tokens_min=4,
    output_tokens_max=12,
    shared_prefix_share=0.5,
    shared_prefix_tokens=16,
    vocab_size=512,
    seed=7,
)


def test_percentile_interpolates_between_ranks():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    assert math.isnan(percentile([], 50))


def _result(sent: float, first: float, gap: float, tokens: int, **fields) -> RequestResult:
    return RequestResult(sent_at=sent, token_times=[first + i * gap for i in range(tokens)], **fields)


def test_summarize_counts_throughput_goodput_and_prefix_hits():
    results = [
        _result(0.0, 0.1, 0.01, 11, prompt_tokens=100, cached_tokens=50),  # meets the SLO
        _result(0.0, 0.5, 0.01, 11, prompt_tokens=100),  # TTFT too long
        _result(1.0, 1.1, 0.05, 11, prompt_tokens=100),  # TPOT too long; ends at 1.6 s
        RequestResult(sent_at=0.5, error="UNAVAILABLE: worker gone"),
    ]
    summary = summarize(results, Slo(ttft_s=0.2, tpot_s=0.02))
    assert (summary.requests, summary.failed, summary.output_tokens) == (4, 1, 33)
    assert summary.duration_s == pytest.approx(1.6)
    assert summary.output_tokens_per_s == pytest.approx(33 / 1.6)
    assert summary.goodput_per_s == pytest.approx(1 / 1.6)
    assert summary.ttft[0] == pytest.approx(0.1)
    assert summary.tpot[0] == pytest.approx(0.01) and summary.tpot[2] == pytest.approx(0.0492)
    assert summary.itl[0] == pytest.approx(0.01)
    assert summary.prefix_hit_rate == pytest.approx(50 / 300)
    assert summary.ttft_p50_prefix_hit == pytest.approx(0.1)
    assert summary.ttft_p50_prefix_miss == pytest.approx(0.3)


def test_workload_is_deterministic_and_within_its_bounds():
    requests = make_requests(SPEC)
    assert requests == make_requests(SPEC)
    assert requests != make_requests(dataclasses.replace(SPEC, seed=8))
    assert len(requests) == SPEC.requests
    for request in requests:
        assert SPEC.prompt_tokens_min <= len(request.prompt_token_ids) <= SPEC.prompt_tokens_max
        assert SPEC.output_tokens_min <= request.output_tokens <= SPEC.output_tokens_max
        assert all(FIRST_ORDINARY_TOKEN <= t < SPEC.vocab_size for t in request.prompt_token_ids)
    sharing = [r for r in requests if r.shares_prefix]
    assert 0.35 < len(sharing) / len(requests) < 0.65
    prefix = sharing[0].prompt_token_ids[: SPEC.shared_prefix_tokens]
    assert all(r.prompt_token_ids[: SPEC.shared_prefix_tokens] == prefix for r in sharing)
    assert not any(r.prompt_token_ids[: SPEC.shared_prefix_tokens] == prefix for r in requests if not r.shares_prefix)


def test_poisson_arrivals_have_the_rate_and_replay_identically():
    arrivals = poisson_arrivals(20000, rate_per_s=4.0, seed=3)
    assert arrivals == poisson_arrivals(20000, rate_per_s=4.0, seed=3)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(4.0, rel=0.03)
    timed = with_arrivals(make_requests(SPEC), 4.0, seed=3)
    assert [r.arrival_s for r in timed] == arrivals[: SPEC.requests]
    with pytest.raises(ValueError, match="must be positive"):
        poisson_arrivals(3, rate_per_s=0.0, seed=0)


def test_shared_prefix_prompts_share_exactly_the_fraction():
    cold, warm = shared_prefix_prompts(100, 0.9, 3, vocab_size=512, seed=1)
    assert len(cold) == 3 and len(warm) == 4
    assert all(len(p) == 100 for p in cold + warm)
    assert all(p[:90] == warm[0][:90] for p in warm)
    assert len({tuple(p[90:]) for p in warm}) == 4
    assert len({tuple(p[:90]) for p in cold + warm[:1]}) == 4  # cold prompts share nothing of it


def test_report_says_no_when_a_greedy_output_differs():
    report = BenchReport(
        profile="quick", model="diptych-tiny", concurrency=32, slo=Slo(0.5, 0.05), split_threads=1, colocated_threads=2
    )
    report.greedy = [GreedyCheck("split", 8, 8, []), GreedyCheck("colocated", 8, 7, [])]
    report.prefix = [
        PrefixEffect("split", 768, 0.9, cold_ttft_p50=0.2, warm_ttft_p50=0.05, warm_cached_tokens=[672], errors=[])
    ]
    text = render_report(report)
    assert "split: identical: yes (8/8 prompts)" in text
    assert "colocated: identical: no (7/8 prompts)" in text
    assert "greedy outputs identical to generate: no" in text
    assert "split: 25% (target ≤ 30%: met)" in text


def test_static_batch_gives_every_request_its_length_with_timestamps_in_order():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DIPTYCH_TINY.llama_config)).eval()
    generate = StaticBatchGenerate(model, pad_token_id=2)
    requests = [BenchRequest(0, [10, 11, 12], 3), BenchRequest(1, [20, 21, 22, 23, 24], 6)]
    results = generate.run_batch(requests, [0.0, 0.0])
    assert [len(r.token_times) for r in results] == [3, 6]
    assert [len(r.token_ids) for r in results] == [3, 6]
    assert all(r.token_times == sorted(r.token_times) for r in results)
    # The longer, unpadded row must decode exactly as batch-1 greedy does (EOS suppressed in both).
    alone = generate.run_batch([requests[1]], [0.0])[0]
    assert results[1].token_ids == alone.token_ids


def test_kv_target_is_read_from_the_microbenchmark_table():
    report = BenchReport(
        profile="full", model="diptych-100m", concurrency=32, slo=Slo(3, 0.3), split_threads=1, colocated_threads=2
    )
    report.kv_transfer_output = "\n".join(
        [
            "     size  path            GB/s  ratio vs alone",
            "    1.0MB  tcp path        1.00   0.40     0.40",
            "   25.2MB  raw socket      2.00   1.00     0.50",
            "   25.2MB  tcp path        3.20   1.60     0.80",
            "   25.2MB  shm path        2.00   1.00     0.50",
            "   25.2MB  raw, alone      4.00   2.00     1.00",
            "   25.2MB  raw, hot        6.00   3.00     1.50",
            "   25.2MB  grpc stream     0.80   0.40     0.20",
        ]
    )
    text = render_report(report)
    assert (
        "KV transfer of 25.2 MB, tcp path: 3.20 GB/s = 80% of the raw socket sent from a process of its own "
        "(target ≥ 70%: met)" in text
    )
    assert (
        "KV transfer of 25.2 MB, shm path: 2.00 GB/s = 50% of the raw socket sent from a process of its own "
        "(target ≥ 70%: NOT met)" in text
    )
    assert "25.2 MB, grpc stream" not in text
    assert "KV transfer of 1.0 MB" not in text and "KV transfer of 1 MB" not in text
    assert "25.2 MB, raw" not in text


def _closed_loop_run(tokens_per_s: float, ttft: float) -> tuple:
    """Two requests whose throughput orders like tokens_per_s; ttft (a few ms) marks the run."""
    results = [_result(0.0, ttft, 0.0, 1), _result(0.0, ttft, 1.0 / tokens_per_s, 10)]
    return summarize(results, Slo(1.0, 1.0)), results


def test_the_median_closed_loop_run_stands_for_its_mode_and_sets_the_ratio():
    report = BenchReport(
        profile="full", model="diptych-100m", concurrency=32, slo=Slo(3.0, 0.3), split_threads=1, colocated_threads=2
    )
    report.add_closed_loop("colocated", [_closed_loop_run(r, t) for r, t in ((100, 0.001), (160, 0.002), (130, 0.003))])
    report.add_closed_loop("generate", [_closed_loop_run(r, 0.005) for r in (40, 50)])
    chosen = report.closed_loop["colocated"]
    assert chosen.ttft[0] == pytest.approx(0.003)  # the 130 tok/s run, not the fastest nor the slowest
    assert report.closed_loop["generate"].output_tokens_per_s == _closed_loop_run(40, 0.005)[0].output_tokens_per_s
    ratio = chosen.output_tokens_per_s / report.closed_loop["generate"].output_tokens_per_s
    text = render_report(report)
    assert f"| colocated | 2 (0) | {chosen.output_tokens_per_s:.0f} | " in text
    runs = ", ".join(
        f"{s.output_tokens_per_s:.0f}"
        for s in (_closed_loop_run(100, 0.001)[0], _closed_loop_run(160, 0.002)[0], _closed_loop_run(130, 0.003)[0])
    )
    assert f"| {runs} | {ratio:.2f}x |" in text
    assert f"colocated / generate: {ratio:.2f}x" in text


def test_engine_only_closed_loop_delivers_every_requested_token(capsys):
    from bench.engine_only import main
    from bench.profiles import QUICK
    from bench.run import closed_loop_requests

    expected = sum(request.output_tokens for request in closed_loop_requests(QUICK, 0))
    assert main(["--profile", "quick", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"run 1: {expected} tokens in " in out
    assert "median: " in out and "steps of ≤" in out


def test_step_costs_prints_each_piece_against_the_other_way(capsys):
    from bench.step_costs import main

    assert main(["--model", "diptych-tiny", "--threads", "1", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    pieces = ("LM head, 32 rows", "KV of 32 sequences", "gather against paged-cpu", "prefill step of 4 x 128")
    for piece in pieces:
        assert piece in out


def test_the_report_says_how_many_split_requests_ran_whole_on_the_decode_worker():
    report = BenchReport(
        profile="full", model="diptych-100m", concurrency=32, slo=Slo(3.0, 0.3), split_threads=1, colocated_threads=2
    )
    results = [
        _result(0.0, 0.1, 0.01, 5, prefill_worker="prefill-0", decode_worker="decode-0"),
        _result(0.0, 0.1, 0.01, 5, prefill_worker="decode-0", decode_worker="decode-0"),
        _result(0.0, 0.1, 0.01, 5, prefill_worker="prefill-0", decode_worker="decode-0"),
    ]
    report.add_closed_loop("split", [(summarize(results, Slo(1.0, 1.0)), results)])
    assert "1 of 3 requests ran whole on the decode worker" in render_report(report)
    report.add_closed_loop("colocated", [(summarize(results, Slo(1.0, 1.0)), results)])
    assert report.split_whole_on_decode == (1, 3)


def test_decode_floor_prints_each_batch_against_its_floor(capsys):
    from bench.decode_floor import main

    assert main(["--model", "diptych-tiny", "--threads", "1", "--batches", "1,4", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "float32" in lines[0] and "GB/s" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [row[:2] for row in rows] == [["auto=paged-cpu", "1"], ["auto=paged-cpu", "4"]]  # a worker's choice
    for row in rows:
        eager_ms, floor_ms = float(row[3]), float(row[5])
        assert floor_ms > 0 and row[6] in ("memory", "compute")
        assert float(row[7].removesuffix("x")) == pytest.approx(eager_ms / floor_ms, rel=0.02)  # of rounded figures


def test_decode_floor_measures_each_backend_asked_for_side_by_side(capsys):
    from bench.decode_floor import main

    argv = ["--model", "diptych-tiny", "--threads", "1", "--batches", "1,3", "--context", "32", "--repeats", "1"]
    assert main([*argv, "--attention", "gather,paged-cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[2:6]] == [
        ["gather", "1"],
        ["paged-cpu", "1"],
        ["gather", "3"],
        ["paged-cpu", "3"],
    ]
    eager = {(row[0], row[1]): float(row[3]) for row in map(str.split, lines[2:6])}
    assert lines[6] == "side by side (eager), ms per decode step; ratios against gather:"
    for batch, row in zip(("1", "3"), map(str.split, lines[8:10]), strict=True):
        assert row[0] == batch
        assert float(row[1]) == eager["gather", batch] and float(row[2]) == eager["paged-cpu", batch]
        assert float(row[3].removesuffix("x")) == pytest.approx(float(row[2]) / float(row[1]), rel=0.02)


def test_a_backend_asked_for_by_name_that_cannot_run_stops_the_benchmark_before_it_loads(capsys):
    from bench.decode_floor import main as decode_floor
    from bench.gpu_serving import main as gpu_serving

    for main in (decode_floor, gpu_serving):
        with pytest.raises(SystemExit) as stopped:
            main(["--device", "cpu", "--model", "diptych-tiny", "--attention", "gather,flash-varlen"])
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert "--attention flash-varlen cannot run on cpu" in error and "CUDA devices only" in error
        assert "loading" not in error


def test_migration_parity_compares_every_migrated_stream_and_the_reference(capsys):
    from bench.migration_parity import main

    assert (
        main(
            [
                "--streams",
                "3",
                "--output-tokens",
                "10",
                "--prompt-min",
                "5",
                "--prompt-max",
                "40",
                "--cuts",
                "0.3",
                "0.7",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "diptych-tiny: 3 greedy streams" in out
    assert "migrated after token 3: " in out and "migrated after token 7: " in out
    assert "of 6 migrated streams diverge" in out and "largest drift of the chosen token" in out
    assert "of 3 undisturbed streams differ from transformers generate" in out


def test_migration_parity_finds_the_first_difference_and_the_gap_there():
    from bench import migration_parity as parity

    assert parity.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert parity.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert parity.first_difference([1, 2, 3], [1, 2]) == 2
    assert parity.margin(([5.0, 4.5, 1.0], [7, 9, 3]), 7, 9) == 0.5
    assert parity.margin(([5.0, 4.5], [7, 9]), 7, 3) is None
    whole = parity.Stream([0], tokens=[10, 11, 12, 13], top={2: ([3.0, 2.9], [12, 20])})
    migrated = parity.Stream([0, 10], tokens=[11, 20, 21], top={2: ([3.1, 3.05], [20, 12])})
    (divergence,) = parity.migrate_and_compare([whole], [migrated], cut=1)
    assert divergence.at == 2
    assert divergence.undisturbed_margin == pytest.approx(0.1)
    assert divergence.migrated_margin == pytest.approx(0.05)
    assert parity.migrate_and_compare([whole], [parity.Stream([0, 10], tokens=[11, 12, 13])], cut=1) == []
    whole = parity.Stream([0], tokens=[10, 11, 12], top={1: ([2.0, 1.0], [11, 5]), 2: ([3.0, 1.0], [12, 5])})
    migrated = parity.Stream([0, 10], tokens=[11, 12], top={1: ([2.5, 1.0], [11, 5]), 2: ([2.9, 1.0], [12, 5])})
    assert parity.largest_drift([whole], [migrated], cut=1) == pytest.approx(0.5)


def test_sampler_cost_prints_a_row_per_shape_and_a_column_per_kind(capsys):
    from bench.sampler_cost import KINDS, SHAPES, main

    assert main(["--calls", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(SHAPES)
    assert all(len(line.split()) == 3 + len(KINDS) for line in lines[2:])  # "8 x 4096" then a figure per kind


def test_gpu_serving_compares_both_engines_on_the_same_tokens(capsys):
    from bench.gpu_serving import NAME_WIDTH, main

    argv = ["--device", "cpu", "--model", "diptych-tiny", "--concurrency", "4", "--requests", "6"]
    assert main([*argv, "--prompt-tokens", "16", "--output-tokens", "8", "--kv-cache-mib", "16", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("vs gather, CUDA graphs off")
    rows = {line[:NAME_WIDTH].strip(): line[NAME_WIDTH:].split() for line in lines[2:]}
    engines = {"diptych, gather, CUDA graphs off", "diptych, paged-cpu, CUDA graphs off"}
    assert set(rows) == {"transformers continuous batching", *engines}
    assert rows["transformers continuous batching"][1] == "1.00x" and len(rows["transformers continuous batching"]) == 3
    # all greedy over the same float32 model on the CPU: every output agrees token for token
    assert all(rows[engine][2] == "6/6" for engine in engines)
    assert rows["diptych, gather, CUDA graphs off"][3] == "1.00x"  # the before, against itself
    paged, gather = rows["diptych, paged-cpu, CUDA graphs off"], rows["diptych, gather, CUDA graphs off"]
    assert float(paged[3].removesuffix("x")) == pytest.approx(float(paged[0]) / float(gather[0]), rel=0.02)


def test_transformers_continuous_batching_gets_the_kv_memory_of_diptychs_pool():
    import argparse

    from bench.gpu_serving import transformers_batching
    from workers.runner.model_loader import load_model

    loaded = load_model("diptych-tiny", "builtin:diptych-tiny")
    config = transformers_batching(loaded, argparse.Namespace(concurrency=4, token_budget=512, kv_cache_mib=16))
    # diptych-tiny: 4 layers x K and V x 2 kv heads x 64 dims x 4 bytes = 4 KiB a token, 1 MiB a page of 256
    assert (config.num_blocks, config.page_size, config.max_requests_per_batch) == (16, 256, 4)


def test_gpu_serving_on_the_cpu_stays_within_a_few_hundred_mib():
    """Left to size its own cache, transformers' continuous batching took 80% of the host's memory (12 GB)."""
    import subprocess
    import sys

    from diptych_server.stack import REPO_ROOT

    argv = ["--device", "cpu", "--model", "diptych-tiny", "--requests", "2", "--concurrency", "2", "--attention"]
    argv += ["gather", "--prompt-tokens", "8", "--output-tokens", "4", "--kv-cache-mib", "16", "--threads", "1"]
    measure = (  # in a process of its own, whose only child is the run: this one's children are the suite's
        "import resource, subprocess, sys; "
        f"subprocess.run([sys.executable, '-m', 'bench.gpu_serving', *{argv!r}], check=True, capture_output=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    result = subprocess.run([sys.executable, "-c", measure], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) < 2 * 2**20  # KiB: under 2 GiB, where the engines' pools take 16 MiB each


def test_split_ttft_serves_a_prompt_stretched_past_the_model_on_every_path_here(capsys):
    from bench.split_ttft import main
    from workers.kv_connector.nixl import nixl_unavailable

    assert main(["--model", "diptych-tiny", "--prompt-tokens", "1100", "--samples", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    paths = ["tcp", "shm"] + (["nixl"] if nixl_unavailable() is None else [])
    assert list(rows) == paths
    for path, row in rows.items():
        assert f"(reported: {path})" in row  # the pair really moved the KV on the path under test
