"""`diptych plan` at fleet scale: how long it takes to answer, and how far its analytic first cut and its
narrowed search land from the full simulated search.

    .venv/bin/python -m bench.planner_scale times --rates 2 40 400 4000 [--tree DIR] [--timeout 600]
    .venv/bin/python -m bench.planner_scale error
    .venv/bin/python -m bench.planner_scale scaling [--cases 0 1] [--scales 2 4 8]

`times` runs `diptych plan --preset chat --rate R --json` from the source tree `--tree` (default this one:
give a `git worktree` of an older commit to time the code before a change) in a fresh process per rate, and
prints the wall and CPU seconds to the answer and the fleets it found; a run past `--timeout` is stopped
and reported with the last progress line it wrote.

`error` plans each case three ways on the same trace: the analytic model alone (no simulation), the
default search (the analytic cut, then simulation near it) and the full search (simulation from the
smallest fleet up, as the planner searched before it had a model), and prints the fleets and their
p50/p99 TTFT and TPOT with the relative difference of each against the full search.

`scaling` plans each of SCALING_CASES (rates whose trace spans the planner's horizon, so the direct plan
is the reference) directly and with each forced rate scale k (planned for the rate / k, counts multiplied
by k), and prints the fleets and their p50/p99 TTFT and TPOT relative to the direct answer's.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.progress import log

ROOT = Path(__file__).resolve().parent.parent
PLAN = "import sys; from diptych_server.cli import main; sys.exit(main(sys.argv[1:]))"


def time_plan(tree: Path, profile: Path | None, preset: str, rate: float, timeout_s: float) -> dict:
    """One `diptych plan` in a fresh process from `tree`: its wall and CPU seconds and its answer."""
    argv = [sys.executable, "-c", PLAN, "plan", "--preset", preset, "--rate", f"{rate:g}", "--json"]
    if profile is not None:
        argv += ["--profile", str(profile)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in err.splitlines() if line.strip()]
    record = {"rate": rate, "wall_s": wall, "cpu_s": cpu, "answered": process.returncode == 0}
    if process.returncode == 0:
        record["plan"] = json.loads(out)
    record["last_progress"] = lines[-1].strip() if lines else ""
    record["progress_lines"] = len(lines)
    return record


def _fleet(found: dict | None) -> str:
    if found is None:
        return "none"
    if found["colocated"]:
        return f"{found['colocated']} colocated"
    return f"{found['prefill']}P+{found['decode']}D"


def print_times(records: list[dict], tree: Path) -> None:
    print(f"tree: {tree}")
    print(f"{'rate':>6} {'wall s':>8} {'CPU s':>8} {'fleets':>7} {'k':>4} {'split':>12} {'colocated':>14}  note")
    for record in records:
        if record["answered"]:
            plan = record["plan"]
            model = f"the model: {_fleet(plan['model_split'])}, {_fleet(plan['model_colocated'])}"
            print(
                f"{record['rate']:>6g} {record['wall_s']:>8.1f} {record['cpu_s']:>8.1f} {plan['simulations']:>7} "
                f"{plan.get('rate_scale', 1):>4} {_fleet(plan['split']):>12} {_fleet(plan['colocated']):>14}  {model}"
            )
        else:
            print(
                f"{record['rate']:>6g} {record['wall_s']:>8.1f} {record['cpu_s']:>8.1f} {'-':>7} {'-':>4} {'-':>12} "
                f"{'-':>14}"
                f"  no answer; stopped after {record['progress_lines']} progress lines, the last: "
                f"{record['last_progress']!r}"
            )


ERROR_CASES = (  # (profile, preset, rate): cases where the full search finishes in minutes
    ("cpu", "chat", 2.0),
    ("cpu", "summarize", 1.0),
    ("hand", "chat", 60.0),
    ("hand", "chat", 300.0),
    ("hand", "summarize", 10.0),
    ("hand", "code", 20.0),
)
PROFILES = {
    "cpu": ROOT / "planner" / "profiles" / "cpu-diptych-100m.json",
    "hand": ROOT / "tests" / "planner" / "hand_profile.json",
}


def error_rows(profile_name: str, preset_name: str, rate: float) -> list[dict]:
    """The case planned by the model alone, the narrow search and the full search: one row per (mode, way)."""
    from planner.profile import load_profile
    from planner.search import Goal, plan
    from planner.workload import PRESETS

    profile, preset = load_profile(PROFILES[profile_name]), PRESETS[preset_name]
    workload, goal = preset.workload(rate_per_s=rate), Goal(preset.slo(profile))
    rows = []
    started = time.process_time()
    narrow = plan(profile, workload, goal)
    narrow_s, started = time.process_time() - started, time.process_time()
    full = plan(profile, workload, goal, search="full")
    full_s = time.process_time() - started
    case = f"{profile_name} {preset_name} {rate:g}/s"
    for mode in ("split", "colocated"):
        reference = getattr(full, mode)
        model = getattr(narrow, f"model_{mode}")
        for way, found, seconds, sims in (
            ("model", model, narrow_s, narrow.simulations),
            ("narrow", getattr(narrow, mode), narrow_s, narrow.simulations),
            ("full", reference, full_s, full.simulations),
        ):
            rows.append(
                {
                    "case": case,
                    "mode": mode,
                    "way": way,
                    "found": found,
                    "reference": reference,
                    "cpu_s": seconds,
                    "simulations": sims,
                }
            )
    return rows


SCALING_CASES = (  # (profile, preset, rate): traces that span the horizon, so the direct plan is computed
    ("hand", "chat", 200.0),
    ("cpu", "chat", 40.0),
)


def scaling_rows(profile_name: str, preset_name: str, rate: float, scales: list[int]) -> list[dict]:
    """The case planned directly and at each forced rate scale: one row per (mode, scale)."""
    from planner.profile import load_profile
    from planner.search import Goal, plan
    from planner.workload import PRESETS

    profile, preset = load_profile(PROFILES[profile_name]), PRESETS[preset_name]
    workload, goal = preset.workload(rate_per_s=rate), Goal(preset.slo(profile))
    plans = {}
    for scale in [1, *scales]:
        log(f"  rate scale {scale}: planning {rate / scale:g} requests/s ...")
        started = time.process_time()
        plans[scale] = (plan(profile, workload, goal, rate_scale=scale), time.process_time() - started)
    case = f"{profile_name} {preset_name} {rate:g}/s"
    rows = []
    for mode in ("split", "colocated"):
        reference = getattr(plans[1][0], mode)
        for scale, (found, seconds) in plans.items():
            rows.append(
                {
                    "case": case,
                    "mode": mode,
                    "way": "direct" if scale == 1 else f"k={scale}",
                    "found": getattr(found, mode),
                    "reference": reference,
                    "cpu_s": seconds,
                    "simulations": found.simulations,
                }
            )
    return rows


SCALING_HEADER = (
    "| case | mode | way | fleet | TTFT p50 / p99 ms | TPOT p50 / p99 ms | vs direct: workers, TTFT p50, p99, "
    "TPOT p50, p99 | CPU s (fleets simulated) |\n|---|---|---|---|---|---|---|---|"
)


def _figures(found) -> tuple[int, float, float, float, float] | None:
    if found is None:
        return None
    return found.fleet.workers, found.ttft_p50_s, found.ttft_p99_s, found.tpot_p50_s, found.tpot_p99_s


ERROR_HEADER = (
    "| case | mode | way | fleet | TTFT p50 / p99 ms | TPOT p50 / p99 ms | vs full: workers, TTFT p50, p99, "
    "TPOT p50, p99 | CPU s (fleets simulated) |\n|---|---|---|---|---|---|---|---|"
)


def print_errors(rows: list[dict]) -> None:
    for row in rows:
        found, reference = _figures(row["found"]), _figures(row["reference"])
        fleet = "none" if row["found"] is None else _shape(row["found"].fleet)
        if found is None:
            ttft = tpot = versus = "-"
        else:
            ttft = f"{found[1] * 1000:.0f} / {found[2] * 1000:.0f}"
            tpot = f"{found[3] * 1000:.1f} / {found[4] * 1000:.1f}"
            versus = (
                "-"
                if reference is None
                else ", ".join(
                    f"{(mine - theirs) / theirs:+.1%}" if theirs else "-"
                    for mine, theirs in zip(found, reference, strict=True)
                )
            )
        figures = f"{row['cpu_s']:.1f} ({row['simulations']})" if row["way"] != "model" else "(no simulation)"
        print(f"| {row['case']} | {row['mode']} | {row['way']} | {fleet} | {ttft} | {tpot} | {versus} | {figures} |")


def _shape(fleet) -> str:
    return f"{fleet.colocated} colocated" if fleet.colocated else f"{fleet.prefill}P+{fleet.decode}D"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner_scale", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    times = commands.add_parser("times", help="time `diptych plan` at several rates")
    times.add_argument("--tree", type=Path, default=ROOT, help="the source tree to run (default: this one)")
    times.add_argument("--profile", type=Path, help="the cost profile (default: the plan command's)")
    times.add_argument("--preset", default="chat")
    times.add_argument("--rates", type=float, nargs="+", default=[2, 40, 400, 4000])
    times.add_argument("--timeout", type=float, default=600.0, help="seconds one plan may take")
    times.add_argument("--json", type=Path, help="also write the records here")
    error = commands.add_parser("error", help="the model and the narrow search against the full search")
    error.add_argument("--cases", type=int, nargs="+", help="which of ERROR_CASES (0-based; default all)")
    scaling = commands.add_parser("scaling", help="plans scaled from a lower rate against the direct plan")
    scaling.add_argument("--cases", type=int, nargs="+", help="which of SCALING_CASES (0-based; default all)")
    scaling.add_argument("--scales", type=int, nargs="+", default=[2, 4, 8], help="the rate scales k to force")
    args = parser.parse_args(argv)
    if args.command == "scaling":
        print(SCALING_HEADER, flush=True)
        for index in args.cases if args.cases is not None else range(len(SCALING_CASES)):
            log(f"planning {SCALING_CASES[index]} directly and scaled by {args.scales} ...")
            print_errors(scaling_rows(*SCALING_CASES[index], args.scales))
            sys.stdout.flush()
    if args.command == "error":
        print(ERROR_HEADER, flush=True)
        for index in args.cases if args.cases is not None else range(len(ERROR_CASES)):
            log(f"planning {ERROR_CASES[index]} three ways ...")
            print_errors(error_rows(*ERROR_CASES[index]))
            sys.stdout.flush()
    if args.command == "times":
        records = []
        for rate in args.rates:
            log(f"diptych plan --preset {args.preset} --rate {rate:g} from {args.tree} ...")
            records.append(time_plan(args.tree.resolve(), args.profile, args.preset, rate, args.timeout))
        print_times(records, args.tree)
        if args.json:
            args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
