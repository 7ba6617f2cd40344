"""The planner's output: the plan as a table or JSON, and the goodput comparison of split and colocated
serving on the presets as a Markdown table and a chart.

    python -m planner.report --chart docs/planner-goodput.png [--profile PATH] [--requests N]

prints the presets' table and draws, for the prefill-heavy and the decode-heavy mix, the share of requests
meeting the SLO against the arrival rate per worker, split (at its best prefill:decode ratio) and colocated.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from planner.analytic import Prediction
from planner.profile import CostProfile, ProfileError, load_profile
from planner.search import Evaluation, Goal, GoodputComparison, Plan, compare_goodput, evaluate, horizon_s
from planner.types import FleetShape, Mode, Slo
from planner.workload import PRESETS, Workload

CHART_MIXES = ("summarize", "chat")


def plan_table(profile: CostProfile, workload: Workload, goal: Goal, result: Plan) -> str:
    slo = goal.slo
    lines = [
        f"profile: {profile.model} on {profile.hardware}",
        f"workload: {workload.rate_per_s:g} requests/s, prompts {_range(workload.prompt)} tokens, outputs "
        f"{_range(workload.output)} tokens, {workload.prefix_share:.0%} open with a {workload.prefix_tokens}-token "
        f"cached prefix",
        f"SLO: TTFT <= {slo.ttft_s * 1000:.1f} ms and TPOT <= {slo.tpot_s * 1000:.2f} ms for "
        f"{goal.attainment:.0%} of requests; at most {goal.max_workers} workers",
        "",
        f"{'fleet':<10} {'workers':>7} {'P:D':>7} {'cost':>8} {'attain':>7} {'TTFT p50/p90 ms':>17} "
        f"{'TPOT p50/p90 ms':>17}",
    ]
    for name, found in (("split", result.split), ("colocated", result.colocated)):
        lines.append(_row(name, found, goal))
    lines += ["", verdict(result, goal), f"({result.simulations} fleets simulated)"]
    if result.rate_scale > 1:
        lines.append(
            f"(rate scaled by {result.rate_scale}: planned for {result.planned_rate_per_s:g} requests/s, whose "
            f"trace spans the planner's horizon, and every count multiplied by {result.rate_scale}; counts are "
            f"multiples of {result.rate_scale}, on the side of more workers)"
        )
    if result.model_split or result.model_colocated:
        lines.append(
            f"(the queueing model's first cut: split {_model(result.model_split)}, colocated "
            f"{_model(result.model_colocated)})"
        )
    return "\n".join(lines)


def _row(name: str, found: Evaluation | None, goal: Goal) -> str:
    if found is None:
        return f"{name:<10} none of up to {goal.max_workers} workers meets the SLO"
    fleet = found.fleet
    ratio = f"{fleet.prefill}:{fleet.decode}" if fleet.mode is Mode.SPLIT else "-"
    ttft = f"{found.ttft_p50_s * 1000:.0f} / {found.ttft_p90_s * 1000:.0f}"
    tpot = f"{found.tpot_p50_s * 1000:.1f} / {found.tpot_p90_s * 1000:.1f}"
    return f"{name:<10} {fleet.workers:>7} {ratio:>7} {found.cost:>8g} {found.attainment:>7.1%} {ttft:>17} {tpot:>17}"


def _model(found: Prediction | None) -> str:
    if found is None:
        return "none"
    fleet = found.fleet
    return f"{fleet.prefill}:{fleet.decode}" if fleet.mode is Mode.SPLIT else f"{fleet.colocated} workers"


def verdict(result: Plan, goal: Goal) -> str:
    split, colocated = result.split, result.colocated
    if split is None and colocated is None:
        return f"neither split nor colocated serving meets the SLO within {goal.max_workers} workers"
    if split is None or colocated is None:
        only = "split" if colocated is None else "colocated"
        return f"{only} wins: only it meets the SLO within {goal.max_workers} workers"
    if split.cost == colocated.cost:
        return f"a tie: both cost {split.cost:g}"
    winner, loser = (split, colocated) if split.cost < colocated.cost else (colocated, split)
    saving = 1 - winner.cost / loser.cost
    return (
        f"{winner.fleet.mode} wins: cost {winner.cost:g} ({winner.fleet.workers} workers) against "
        f"{loser.cost:g} ({loser.fleet.workers} workers), {saving:.0%} less"
    )


def winner(result: Plan) -> str | None:
    split, colocated = result.split, result.colocated
    if split is None or colocated is None:
        return "split" if split else "colocated" if colocated else None
    if split.cost == colocated.cost:
        return "tie"
    return "split" if split.cost < colocated.cost else "colocated"


def plan_json(profile_path: Path, workload: Workload, goal: Goal, result: Plan) -> dict:
    return {
        "profile": str(profile_path),
        "workload": dataclasses.asdict(workload),
        "slo": {"ttft_s": goal.slo.ttft_s, "tpot_s": goal.slo.tpot_s, "attainment": goal.attainment},
        "max_workers": goal.max_workers,
        "split": _evaluation_json(result.split),
        "colocated": _evaluation_json(result.colocated),
        "winner": winner(result),
        "simulations": result.simulations,
        "rate_scale": result.rate_scale,
        "planned_rate_per_s": result.planned_rate_per_s or workload.rate_per_s,
        "model_split": _prediction_json(result.model_split),
        "model_colocated": _prediction_json(result.model_colocated),
    }


def _prediction_json(found: Prediction | None) -> dict | None:
    if found is None:
        return None
    return {**dataclasses.asdict(found.fleet), "mode": str(found.fleet.mode)} | {
        key: value for key, value in dataclasses.asdict(found).items() if key != "fleet"
    }


def _evaluation_json(found: Evaluation | None) -> dict | None:
    if found is None:
        return None
    fleet = found.fleet
    return {
        "prefill": fleet.prefill,
        "decode": fleet.decode,
        "colocated": fleet.colocated,
        "workers": fleet.workers,
        "cost": found.cost,
        "attainment": found.attainment,
        "ttft_p50_s": found.ttft_p50_s,
        "ttft_p90_s": found.ttft_p90_s,
        "tpot_p50_s": found.tpot_p50_s,
        "tpot_p90_s": found.tpot_p90_s,
        "ttft_p99_s": found.ttft_p99_s,
        "tpot_p99_s": found.tpot_p99_s,
    }


def _range(lengths) -> str:
    return str(lengths.low) if lengths.low == lengths.high else f"{lengths.low}-{lengths.high}"


# ---- the presets' goodput: table and chart --------------------------------------------------------------


def goodput_table(comparisons: dict[str, tuple[Slo, GoodputComparison]]) -> str:
    lines = [
        "| mix | TTFT SLO | TPOT SLO | split: best P:D | split goodput / worker | colocated goodput / worker | wins |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (slo, found) in comparisons.items():
        fleet = found.split.fleet
        wins = "split" if found.split_wins else "colocated"
        lines.append(
            f"| {name} | {slo.ttft_s * 1000:.0f} ms | {slo.tpot_s * 1000:.1f} ms | {fleet.prefill}:{fleet.decode} | "
            f"{found.split.per_worker:.2f} req/s | {found.colocated.per_worker:.2f} req/s | {wins} |"
        )
    return "\n".join(lines)


def attainment_curve(
    profile: CostProfile, workload: Workload, fleet: FleetShape, slo: Slo, rates_per_worker: list[float]
) -> list[float]:
    curve = []
    for per_worker in rates_per_worker:
        rate = per_worker * fleet.workers
        requests = workload.at_rate(rate).lasting(horizon_s(profile, workload, rate)).sample()
        curve.append(evaluate(profile, requests, fleet, slo).attainment)
    return curve


def draw_chart(
    profile: CostProfile, comparisons: dict[str, tuple[Slo, GoodputComparison]], path: Path, requests: int
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CHART_MIXES), figsize=(6 * len(CHART_MIXES), 4.2))
    for axis, name in zip(axes, CHART_MIXES, strict=True):
        slo, found = comparisons[name]
        workload = PRESETS[name].workload(requests=requests)
        top = 1.6 * max(found.split.per_worker, found.colocated.per_worker)
        rates = [top * (i + 1) / 16 for i in range(16)]
        for label, fleet, style in (
            (f"split {found.split.fleet.prefill}:{found.split.fleet.decode}", found.split.fleet, "-o"),
            (f"colocated x{found.colocated.fleet.colocated}", found.colocated.fleet, "-s"),
        ):
            axis.plot(rates, attainment_curve(profile, workload, fleet, slo, rates), style, label=label, markersize=4)
        axis.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"{name}: {PRESETS[name].summary}", fontsize=9)
        axis.set_xlabel("arrival rate per worker (requests/s)")
        axis.set_ylabel("share of requests meeting TTFT and TPOT SLO")
        axis.set_ylim(0, 1.02)
        axis.legend()
    figure.suptitle(f"Goodput per worker, split vs colocated ({profile.model} on {profile.hardware})", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", type=Path, default=Path(__file__).resolve().parent / "profiles" / "cpu-diptych-100m.json"
    )
    parser.add_argument("--chart", type=Path, help="write the chart (PNG) here")
    parser.add_argument("--requests", type=int, default=1000, help="requests per simulated trace at least")
    parser.add_argument("--attainment", type=float, default=0.9)
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except ProfileError as error:
        print(f"python -m planner.report: {error}", file=sys.stderr)
        return 2
    comparisons = {}
    for name, preset in PRESETS.items():
        print(f"{name}: comparing goodput ...", file=sys.stderr, flush=True)
        slo = preset.slo(profile)
        comparisons[name] = (
            slo,
            compare_goodput(profile, preset.workload(requests=args.requests), slo, args.attainment),
        )
    print(goodput_table(comparisons))
    if args.chart:
        draw_chart(profile, comparisons, args.chart, args.requests)
        print(f"wrote {args.chart}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
