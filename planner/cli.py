"""`diptych plan`: the cheapest split and colocated fleets meeting an SLO under a workload, from a measured
cost profile, and which of the two costs less. Building the arguments imports nothing heavy (every
`diptych` command builds them); the search is imported when the command runs."""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.profile import MEASURE_COMMAND, CostProfile, ProfileError, load_profile
from planner.types import MAX_WORKERS, Slo
from planner.workload import PRESETS, Lengths, Preset, Workload

if TYPE_CHECKING:
    from planner.search import Goal

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "cpu-diptych-100m.json"


class PlanError(Exception):
    """A bad input to `diptych plan`; the message says which and why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        type=Path,
        default=DEFAULT_PROFILE,
        help=f"the cost profile (JSON) measured by `{MEASURE_COMMAND}` (default: the shipped CPU profile)",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named workload mix with its SLO scales")
    parser.add_argument("--rate", type=float, help="arrivals per second (default: the preset's)")
    parser.add_argument("--prompt-tokens", help="prompt length: 256, or a uniform range 128-512")
    parser.add_argument("--output-tokens", help="output length: 128, or a uniform range 64-256")
    parser.add_argument("--prefix-share", type=float, help="share of requests opening with a cached shared prefix")
    parser.add_argument("--prefix-tokens", type=int, help="the shared prefix's length in tokens")
    parser.add_argument("--requests", type=int, default=2000, help="requests to simulate at least (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, help="the TTFT SLO (default: the preset's scale of the profile)")
    parser.add_argument("--tpot-ms", type=float, help="the TPOT SLO (default: the preset's scale of the profile)")
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting the SLO (0, 1]")
    parser.add_argument("--max-workers", type=int, default=MAX_WORKERS, help=f"fleet size at most (<= {MAX_WORKERS})")
    parser.add_argument("--price-prefill", type=float, default=1.0, help="cost of one prefill worker")
    parser.add_argument("--price-decode", type=float, default=1.0, help="cost of one decode worker")
    parser.add_argument("--price-colocated", type=float, default=1.0, help="cost of one colocated worker")
    parser.add_argument(
        "--search",
        choices=("narrow", "full"),
        default="narrow",
        help="narrow: simulate only near the queueing model's answer, counts within 2%% (default); "
        "full: simulate from the smallest fleet up, exact and slow past a few hundred workers",
    )
    parser.add_argument(
        "--rate-scale",
        type=int,
        help="plan for the rate / K and multiply the counts by K (default: the smallest K whose trace spans the "
        "planner's horizon within its request cap; 1 when the trace at the rate does)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    from planner.report import plan_json, plan_table
    from planner.search import plan

    try:
        profile = load_profile(args.profile)
        workload = workload_from(args)
        goal = goal_from(args, profile)
        if args.rate_scale is not None and args.rate_scale < 1:
            raise PlanError(f"--rate-scale is a whole number of 1 or more, not {args.rate_scale}")
    except (PlanError, ProfileError) as error:
        print(f"diptych plan: {error}", file=sys.stderr)
        return 2

    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"  [{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    print(f"searching up to {goal.max_workers} workers ({args.search} search) ...", file=sys.stderr, flush=True)
    result = plan(profile, workload, goal, progress, args.search, args.rate_scale)
    if args.json:
        print(json.dumps(plan_json(args.profile, workload, goal, result)))
    else:
        print(plan_table(profile, workload, goal, result))
    return 0


def workload_from(args: argparse.Namespace) -> Workload:
    preset = PRESETS[args.preset] if args.preset else None
    if preset is None:
        missing = [flag for flag, value in _workload_flags(args) if value is None]
        if missing:
            raise PlanError(f"without --preset, give {', '.join(missing)}")
    try:
        return Workload(
            rate_per_s=_pick(args.rate, preset and preset.rate_per_s),
            prompt=Lengths.parse(args.prompt_tokens) if args.prompt_tokens else _preset(preset).prompt,
            output=Lengths.parse(args.output_tokens) if args.output_tokens else _preset(preset).output,
            requests=args.requests,
            prefix_share=_pick(args.prefix_share, preset.prefix_share if preset else 0.0),
            prefix_tokens=_pick(args.prefix_tokens, preset.prefix_tokens if preset else 0),
            seed=args.seed,
        )
    except ValueError as error:
        raise PlanError(str(error)) from None


def _workload_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    return [("--rate", args.rate), ("--prompt-tokens", args.prompt_tokens), ("--output-tokens", args.output_tokens)]


def _preset(preset: Preset | None) -> Preset:
    assert preset is not None, "checked by workload_from"
    return preset


def goal_from(args: argparse.Namespace, profile: CostProfile) -> "Goal":
    from planner.search import Goal, Prices

    preset = PRESETS[args.preset] if args.preset else None
    if preset is None and (args.ttft_ms is None or args.tpot_ms is None):
        raise PlanError("without --preset, give the SLO: --ttft-ms and --tpot-ms")
    scaled = preset.slo(profile) if preset else Slo(0.0, 0.0)
    ttft_s = args.ttft_ms / 1000 if args.ttft_ms is not None else scaled.ttft_s
    tpot_s = args.tpot_ms / 1000 if args.tpot_ms is not None else scaled.tpot_s
    prices = Prices(args.price_prefill, args.price_decode, args.price_colocated)
    if min(prices.prefill, prices.decode, prices.colocated) <= 0:
        raise PlanError("worker prices must be positive")
    try:
        return Goal(Slo(ttft_s, tpot_s), args.attainment, args.max_workers, prices)
    except ValueError as error:
        raise PlanError(str(error)) from None


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value
