"""The serving benchmark: `python -m bench.run --profile quick|full` (`make bench`, `make bench-full`).

Starts the control plane, then one mode at a time: the split gateway with 1 prefill + 1 decode worker,
then the colocated gateway with 1 worker, replaying the profile's workload against each; stops the
platform, replays the same workload through plain `transformers` `generate` in this process, runs the
KV data-path microbenchmark, and prints every figure side by side with the targets as ratios.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.baseline import StaticBatchGenerate
from bench.gateway_client import GatewayClient
from bench.live_platform import MODES, save_model, start_platform
from bench.profiles import PROFILES, Profile
from bench.progress import log
from bench.report import BenchReport, GreedyCheck, PrefixEffect, render_chart, render_report
from bench.stats import RunSummary, percentile, summarize
from bench.workload import make_requests, shared_prefix_prompts, with_arrivals
from diptych_server.stack import REPO_ROOT

BASELINE = "generate"
CLOSED_LOOP_SEED, GREEDY_SEED, PREFIX_SEED = 1000, 2000, 3000


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = PROFILES[args.profile]
    if args.rates:
        profile = dataclasses.replace(profile, rates_per_s=tuple(args.rates))
    if args.poisson_requests:
        profile = dataclasses.replace(profile, poisson_requests=args.poisson_requests)
    if args.closed_loop_requests:
        profile = dataclasses.replace(profile, closed_loop_requests=args.closed_loop_requests)
    torch.set_num_threads(max(args.generate_threads))
    with tempfile.TemporaryDirectory(prefix="diptych-bench-") as scratch:
        report = run_benchmark(profile, Path(scratch), args)
    text = render_report(report)
    print(text, flush=True)
    if args.chart:
        render_chart(report, args.chart)
        log(f"chart written to {args.chart}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=1, default=str))
        log(f"results written to {args.json}")
    return 0


def run_benchmark(profile: Profile, scratch: Path, args) -> BenchReport:
    log(f"profile {profile.name}: model {profile.model}; saving it with `diptych model save` and loading it")
    save_model(profile.model, scratch / "model")
    model = AutoModelForCausalLM.from_pretrained(scratch / "model")
    model.eval()
    generate = StaticBatchGenerate(model, pad_token_id=model.config.pad_token_id)
    greedy_prompts = _greedy_prompts(profile)
    log(f"reference greedy outputs for {len(greedy_prompts)} prompts with `generate`")
    references = [generate.greedy(p, profile.greedy_max_tokens) for p in greedy_prompts]

    report = BenchReport(
        profile=profile.name,
        model=profile.model,
        concurrency=profile.concurrency,
        slo=profile.slo,
        split_threads=args.split_threads,
        colocated_threads=args.colocated_threads,
        tree_state=_tree_state(),
    )
    report.load_average.append(os.getloadavg()[0])
    platform = start_platform(
        scratch / "stack", profile.model, profile.context_length, args.split_threads, args.colocated_threads, log
    )
    try:
        for mode in MODES:
            with platform.serving(mode) as address:
                asyncio.run(
                    _measure_platform_mode(address, platform.api_key, mode, profile, greedy_prompts, references, report)
                )
    finally:
        log("stopping the control plane")
        platform.stop()

    _measure_baseline(generate, profile, report, args.generate_threads)
    if not args.skip_kv:
        report.kv_transfer_output = _kv_transfer(args.kv_args)
    report.load_average.append(os.getloadavg()[0])
    log("done")
    return report


async def _measure_platform_mode(address, api_key, mode, profile, greedy_prompts, references, report) -> None:
    async with GatewayClient(address, api_key, profile.model) as client:
        log(f"[{mode}] warming up")
        for request in make_requests(dataclasses.replace(profile.workload, requests=2, seed=9)):
            await client.generate(request.prompt_token_ids, 4)

        log(f"[{mode}] greedy check: {len(greedy_prompts)} prompts against `generate`")
        outputs = [await client.generate(p, profile.greedy_max_tokens, ignore_eos=False) for p in greedy_prompts]
        report.greedy.append(
            GreedyCheck(
                mode,
                len(references),
                sum(o.token_ids == r for o, r in zip(outputs, references, strict=True)),
                [o.error for o in outputs if o.error][:3],
            )
        )

        runs = []
        for repeat in range(profile.closed_loop_repeats):
            requests = closed_loop_requests(profile, repeat)
            log(
                f"[{mode}] closed loop {repeat + 1} of {profile.closed_loop_repeats}: {len(requests)} requests, "
                f"{profile.concurrency} at a time"
            )
            results = await client.replay_closed_loop(requests, profile.concurrency)
            runs.append((_logged(mode, summarize(results, profile.slo)), results))
        report.add_closed_loop(mode, runs)

        for run, rate in enumerate(profile.rates_per_s):
            requests = _poisson_requests(profile, run, rate)
            log(f"[{mode}] Poisson {rate:g} req/s: {len(requests)} requests over ~{requests[-1].arrival_s:.0f} s")
            results = await client.replay_open_loop(requests)
            report.add_poisson(mode, rate, _logged(mode, summarize(results, profile.slo)))

        log(
            f"[{mode}] prefix cache: {profile.prefix_samples} cold prompts and {profile.prefix_samples} sharing "
            f"{profile.prefix_shared_fraction:.0%} of {profile.prefix_prompt_tokens} tokens"
        )
        report.prefix.append(await _prefix_effect(client, mode, profile))


def _measure_baseline(generate: StaticBatchGenerate, profile: Profile, report: BenchReport, threads: list[int]) -> None:
    """The closed loop once per torch thread count; the fastest count (the ratios favour `generate`) runs
    it again until it has run as often as the platform's modes, and the Poisson runs use that count."""
    runs_by_count = {}
    for count in threads:
        torch.set_num_threads(count)
        log(f"[{BASELINE}] warming up with {count} torch thread(s)")
        generate.run_batch(make_requests(dataclasses.replace(profile.workload, requests=2, seed=9)), [0.0, 0.0])
        runs_by_count[count] = [_baseline_closed_loop(generate, profile, 0, count)]
    count = max(runs_by_count, key=lambda c: runs_by_count[c][0][0].output_tokens_per_s)
    torch.set_num_threads(count)
    runs = runs_by_count[count]
    while len(runs) < profile.closed_loop_repeats:
        runs.append(_baseline_closed_loop(generate, profile, len(runs), count))
    report.baseline_threads = count
    report.add_closed_loop(BASELINE, runs)
    for run, rate in enumerate(profile.rates_per_s):
        requests = _poisson_requests(profile, run, rate)
        log(
            f"[{BASELINE}] Poisson {rate:g} req/s: {len(requests)} requests, static batches up to "
            f"{profile.baseline_max_batch}"
        )
        results = generate.replay_open_loop(requests, profile.baseline_max_batch)
        report.add_poisson(BASELINE, rate, _logged(BASELINE, summarize(results, profile.slo)))


def _baseline_closed_loop(generate: StaticBatchGenerate, profile: Profile, repeat: int, count: int):
    requests = closed_loop_requests(profile, repeat)
    log(
        f"[{BASELINE}] closed loop, {count} thread(s): {len(requests)} requests in static batches of "
        f"{profile.concurrency}"
    )
    results = generate.replay_closed_loop(requests, profile.concurrency)
    return _logged(BASELINE, summarize(results, profile.slo)), results


async def _prefix_effect(client: GatewayClient, mode: str, profile: Profile) -> PrefixEffect:
    cold, warm = shared_prefix_prompts(
        profile.prefix_prompt_tokens,
        profile.prefix_shared_fraction,
        profile.prefix_samples,
        profile.workload.vocab_size,
        PREFIX_SEED,
    )
    filler = await client.generate(warm[0], 1)  # puts the shared prefix in the cache; not counted
    cold_results, measured = [], []
    for cold_prompt, warm_prompt in zip(cold, warm[1:], strict=True):  # interleaved: both see the same machine load
        cold_results.append(await client.generate(cold_prompt, 1))
        measured.append(await client.generate(warm_prompt, 1))
    return PrefixEffect(
        mode=mode,
        prompt_tokens=profile.prefix_prompt_tokens,
        shared_fraction=profile.prefix_shared_fraction,
        cold_ttft_p50=percentile([r.ttft for r in cold_results if r.ok], 50),
        warm_ttft_p50=percentile([r.ttft for r in measured if r.ok], 50),
        warm_cached_tokens=[r.cached_tokens for r in measured],
        errors=[r.error for r in [filler, *cold_results, *measured] if r.error][:3],
    )


def _logged(mode: str, summary: RunSummary) -> RunSummary:
    log(
        f"[{mode}]   {summary.output_tokens_per_s:.0f} output tok/s, TTFT p50 {summary.ttft[0] * 1000:.0f} ms, "
        f"TPOT p50 {summary.tpot[0] * 1000:.0f} ms, {summary.failed} failed"
    )
    return summary


def _greedy_prompts(profile: Profile) -> list[list[int]]:
    spec = dataclasses.replace(profile.workload, requests=profile.greedy_samples, seed=GREEDY_SEED)
    return [r.prompt_token_ids for r in make_requests(spec)]


def closed_loop_requests(profile: Profile, repeat: int):
    # A fresh seed per repeat, as for the Poisson runs; `generate`'s repeats replay the same sets.
    return make_requests(
        dataclasses.replace(profile.workload, requests=profile.closed_loop_requests, seed=CLOSED_LOOP_SEED + repeat)
    )


def _poisson_requests(profile: Profile, run: int, rate: float):
    # A fresh seed per run: prompts of an earlier run must not already sit in a prefix cache.
    spec = dataclasses.replace(profile.workload, requests=profile.poisson_requests, seed=profile.workload.seed + run)
    return with_arrivals(make_requests(spec), rate, seed=run)


def _tree_state() -> str:
    """The commit measured, and how many files differed from it: the engine changes under active work."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    changed = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
    return f"{git('rev-parse', '--short', 'HEAD') or 'unknown'} with {changed} tracked file(s) modified"


def _kv_transfer(extra_args: list[str]) -> str:
    script = REPO_ROOT / "bench" / "kv_transfer.py"
    if not script.is_file():
        return "bench/kv_transfer.py is not in this tree: no KV transfer figures."
    log("KV data path microbenchmark (bench/kv_transfer.py)")
    result = subprocess.run(
        [sys.executable, "-m", "bench.kv_transfer", *extra_args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout.strip()
    if result.returncode != 0:
        output += f"\n(bench/kv_transfer.py exited with status {result.returncode}: {result.stderr.strip()[-1500:]})"
    return output


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument("--rates", type=float, nargs="+", help="Poisson arrival rates in requests/s")
    parser.add_argument("--poisson-requests", type=int, help="requests per Poisson run (default: the profile's)")
    parser.add_argument("--closed-loop-requests", type=int, help="requests of the closed-loop run")
    parser.add_argument(
        "--generate-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch thread counts to try for `generate` (the fastest is kept)",
    )
    parser.add_argument(
        "--split-threads", type=int, default=1, help="torch threads of the prefill and of the decode worker"
    )
    parser.add_argument("--colocated-threads", type=int, default=2, help="torch threads of the colocated worker")
    parser.add_argument("--chart", type=Path, help="write the latency-against-load chart (PNG) here")
    parser.add_argument("--json", type=Path, help="write every figure as JSON here")
    parser.add_argument("--skip-kv", action="store_true", help="skip the KV data-path microbenchmark")
    parser.add_argument("--kv-args", nargs=argparse.REMAINDER, default=[], help="arguments for bench/kv_transfer.py")
    return parser


if __name__ == "__main__":
    sys.exit(main())
