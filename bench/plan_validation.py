"""The planner's simulator against real runs on this machine: the same request trace served by a real
platform on loopback and simulated with the measured cost profile, side by side.

    .venv/bin/python -m bench.plan_validation --model diptych-100m --rates 0.5 1.5 \\
        --chart docs/planner-validation.png

For each serving mode (1 prefill + 1 decode worker behind a split gateway, then 1 colocated worker behind a
colocated gateway; one mode at a time, each worker with the default `diptych worker` settings) and each
Poisson rate, the trace's requests are sent at their arrival times with fixed output lengths (EOS ignored),
and each request's TTFT and TPOT are measured at the client; `planner.simulator.simulate` runs the same
trace on the same fleet shape, with the gateway's default routing. The table gives measured and predicted
TTFT p50/p90 and TPOT mean/p50/p90 with the relative error (predicted - measured) / measured.
"""

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.gateway_client import GatewayClient
from bench.live_platform import MODES, start_platform
from bench.progress import log
from bench.stats import RequestResult, percentile
from bench.workload import BenchRequest, random_tokens
from diptych_common.builtin import BUILTIN_MODELS
from diptych_server.cli import _parser as _cli_parser
from planner.profile import CostProfile, load_profile
from planner.simulator import RoutingOptions, simulate
from planner.types import FleetShape, Mode, RequestOutcome, RequestSpec
from planner.workload import Lengths, Workload

FLEETS = {"split": FleetShape(Mode.SPLIT, prefill=1, decode=1), "colocated": FleetShape(Mode.COLOCATED, colocated=1)}
PROFILES_DIR = Path(__file__).resolve().parent.parent / "planner" / "profiles"


@dataclass(frozen=True)
class RequestPair:
    """One request of a trace: what the platform measured and what the simulator predicted."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    measured_ttft_s: float
    measured_tpot_s: float
    predicted_ttft_s: float
    predicted_tpot_s: float
    measured_second_token_s: float  # from the first token to the second: a split request's KV hand-off in it


@dataclass(frozen=True)
class Run:
    mode: str
    rate_per_s: float
    pairs: list[RequestPair]
    failed: list[str]  # the errors of requests that did not complete (not compared)
    load_average: float  # the 1-minute load average when the run ended


@dataclass(frozen=True)
class Metric:
    name: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s else math.nan


def gateway_routing() -> RoutingOptions:
    """The split gateway's routing as the platform starts it (the `diptych gateway` defaults)."""
    defaults = _cli_parser().parse_args(["gateway"])
    return RoutingOptions(
        skip_split_below=defaults.skip_split_below, prefill_overflow_tokens=defaults.prefill_overflow_tokens
    )


def make_trace(workload: Workload, vocab_size: int) -> tuple[list[RequestSpec], list[BenchRequest]]:
    """The workload's requests as the simulator takes them and as the client sends them (distinct random
    prompts: no request finds another's blocks in a prefix cache)."""
    specs = workload.sample()
    rng = random.Random(workload.seed + 1)
    sent = [
        BenchRequest(index, random_tokens(rng, spec.prompt_tokens, vocab_size), spec.output_tokens, spec.arrival_s)
        for index, spec in enumerate(specs)
    ]
    return specs, sent


def compare(
    mode: str,
    rate: float,
    specs: list[RequestSpec],
    results: list[RequestResult],
    predicted: list[RequestOutcome],
    load_average: float,
) -> Run:
    pairs, failed = [], []
    for spec, result, outcome in zip(specs, results, predicted, strict=True):
        if not result.ok or len(result.token_ids) != spec.output_tokens:
            failed.append(result.error or f"{len(result.token_ids)} of {spec.output_tokens} tokens")
            continue
        pairs.append(
            RequestPair(
                spec.prompt_tokens,
                spec.output_tokens,
                spec.arrival_s,
                result.ttft,
                result.tpot or 0.0,
                outcome.ttft_s,
                outcome.tpot_s,
                result.token_times[1] - result.token_times[0] if len(result.token_times) > 1 else 0.0,
            )
        )
    return Run(mode, rate, pairs, failed, load_average)


def metrics(run: Run) -> list[Metric]:
    """TTFT over every request; TPOT over those of more than one output token."""
    decoding = [p for p in run.pairs if p.output_tokens > 1]

    def p50(values):
        return percentile(values, 50)

    def p90(values):
        return percentile(values, 90)

    return [
        _metric("TTFT p50", run.pairs, "ttft", p50),
        _metric("TTFT p90", run.pairs, "ttft", p90),
        _metric("TPOT mean", decoding, "tpot", statistics.mean),
        _metric("TPOT p50", decoding, "tpot", p50),
        _metric("TPOT p90", decoding, "tpot", p90),
    ]


def _metric(name: str, pairs: list[RequestPair], field: str, statistic) -> Metric:
    if not pairs:
        return Metric(name, math.nan, math.nan)
    measured = [getattr(p, f"measured_{field}_s") for p in pairs]
    predicted = [getattr(p, f"predicted_{field}_s") for p in pairs]
    return Metric(name, statistic(measured), statistic(predicted))


def render_table(runs: list[Run], profile: CostProfile) -> str:
    lines = [
        f"simulator vs measured: {profile.model}, profile {profile.hardware} ({profile.measured_with})",
        "",
        f"{'mode':<10} {'req/s':>5} {'n':>3}  {'metric':<9} {'measured ms':>11} {'predicted ms':>12} {'error':>7}",
    ]
    for run in runs:
        for metric in metrics(run):
            lines.append(
                f"{run.mode:<10} {run.rate_per_s:>5g} {len(run.pairs):>3}  {metric.name:<9} "
                f"{metric.measured_s * 1000:>11.1f} {metric.predicted_s * 1000:>12.1f} {metric.error:>+7.0%}"
            )
        if run.failed:
            lines.append(f"{'':<10} {len(run.failed)} request(s) failed, not compared: {run.failed[:2]}")
        lines.append(f"{'':<10} load average at the end of the run: {run.load_average:.2f}")
    worst: dict[str, float] = {}
    for run in runs:
        for metric in metrics(run):
            if not math.isnan(metric.error):
                worst[metric.name] = max(worst.get(metric.name, 0.0), abs(metric.error))
    lines += ["", "largest |error| over the runs: " + ", ".join(f"{name} {e:.0%}" for name, e in worst.items())]
    return "\n".join(lines)


def render_chart(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    modes = list(dict.fromkeys(run.mode for run in runs))
    figure, axes = plt.subplots(2, len(modes), figsize=(5.2 * len(modes), 9), squeeze=False)
    for column, mode in enumerate(modes):
        for row, (field, label) in enumerate((("ttft", "TTFT"), ("tpot", "TPOT"))):
            axis = axes[row][column]
            values = []
            for run in (r for r in runs if r.mode == mode):
                pairs = [p for p in run.pairs if field == "ttft" or p.output_tokens > 1]
                measured = [getattr(p, f"measured_{field}_s") * 1000 for p in pairs]
                predicted = [getattr(p, f"predicted_{field}_s") * 1000 for p in pairs]
                axis.scatter(measured, predicted, s=14, alpha=0.7, label=f"{run.rate_per_s:g} req/s")
                values += measured + predicted
            if values:
                low, high = min(values) * 0.8, max(values) * 1.25
                axis.plot([low, high], [low, high], color="grey", linewidth=1, label="predicted = measured")
                axis.set_xlim(low, high)
                axis.set_ylim(low, high)
            axis.set_xscale("log")
            axis.set_yscale("log")
            for scale in (axis.xaxis, axis.yaxis):
                scale.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
                scale.set_major_formatter(plain)
                scale.set_minor_formatter(NullFormatter())
            axis.set_xlabel(f"measured {label} (ms)")
            axis.set_ylabel(f"predicted {label} (ms)")
            axis.set_title(f"{mode}: {label} per request")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


async def _replay(address: str, api_key: str, model: str, traces: dict[float, list[BenchRequest]], vocab_size: int):
    async with GatewayClient(address, api_key, model) as client:
        rng = random.Random(99)
        for _ in range(2):  # warm-up: connections, the workers' first steps; not counted
            await client.generate(random_tokens(rng, 64, vocab_size), 8)
        results = {}
        for rate, requests in traces.items():
            log(f"  {rate:g} req/s: {len(requests)} requests over ~{requests[-1].arrival_s:.0f} s")
            results[rate] = (await client.replay_open_loop(requests), os.getloadavg()[0])
        return results


def run_validation(args, profile: CostProfile) -> list[Run]:
    builtin = BUILTIN_MODELS[args.model]
    vocab_size = builtin.llama_config["vocab_size"]
    context_length = builtin.llama_config["max_position_embeddings"]
    traces = {}
    for run, rate in enumerate(args.rates):
        workload = Workload(rate, args.prompt_tokens, args.output_tokens, args.requests, seed=args.seed + 100 * run)
        traces[rate] = make_trace(workload, vocab_size)
    measured: dict[str, dict[float, tuple[list[RequestResult], float]]] = {}
    with tempfile.TemporaryDirectory(prefix="diptych-plan-validation-") as scratch:
        platform = start_platform(Path(scratch) / "stack", args.model, context_length, args.threads, args.threads, log)
        try:
            for mode in args.modes:
                with platform.serving(mode) as address:
                    log(f"[{mode}] replaying {len(traces)} trace(s)")
                    sent = {rate: requests for rate, (_, requests) in traces.items()}
                    measured[mode] = asyncio.run(_replay(address, platform.api_key, args.model, sent, vocab_size))
        finally:
            platform.stop()
    runs = []
    routing = gateway_routing()
    for mode in args.modes:
        for rate, (specs, _) in traces.items():
            predicted = simulate(profile, specs, FLEETS[mode], routing if mode == "split" else None)
            results, load_average = measured[mode][rate]
            runs.append(compare(mode, rate, specs, results, predicted, load_average))
    return runs


def _lengths(text: str) -> Lengths:
    try:
        return Lengths.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_validation", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-100m", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--profile", type=Path, help="the cost profile (default: planner/profiles/cpu-<model>.json)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.5], help="Poisson arrival rates, req/s")
    parser.add_argument("--requests", type=int, default=30, help="requests per rate")
    parser.add_argument("--prompt-tokens", type=_lengths, default=Lengths(32, 384), help="uniform range, e.g. 32-384")
    parser.add_argument("--output-tokens", type=_lengths, default=Lengths(16, 48), help="uniform range, e.g. 16-48")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--chart", type=Path, help="write the predicted-against-measured chart (PNG) here")
    parser.add_argument("--json", type=Path, help="write every request's figures as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.requests < 1 or args.threads < 1 or min(args.rates) <= 0:
        raise SystemExit("--requests and --threads must be at least 1, and every rate positive")
    profile = load_profile(args.profile or PROFILES_DIR / f"cpu-{args.model}.json")
    if profile.model != args.model:
        raise SystemExit(f"the profile is of {profile.model}, not of {args.model}: pass --profile for {args.model}")
    log(f"load average at the start: {os.getloadavg()[0]:.2f}")
    runs = run_validation(args, profile)
    print(render_table(runs, profile), flush=True)
    if args.chart:
        render_chart(runs, args.chart, f"planner simulator against real runs: {args.model}, {profile.hardware}")
        log(f"chart written to {args.chart}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(run) for run in runs], indent=1))
        log(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
