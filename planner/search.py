"""The cheapest fleet that meets an SLO, and the goodput per worker of split and colocated serving.

Every candidate fleet serves the same sampled requests (one seed), so two candidates differ only by their
shape. The share of requests meeting the SLO grows with workers (within the noise of routing), which lets
the search bisect: for colocated fleets on the count, for split fleets on the count at each prefill share of
`PREFILL_SHARES` (starting near the size found last), then it walks down from the best split found, one
worker at a time, while a smaller fleet still meets the target, so that no fleet one worker smaller meets it.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.profile import CostProfile
from planner.simulator import RoutingOptions, simulate
from planner.types import MAX_WORKERS, FleetShape, Mode, RequestOutcome, RequestSpec, Slo
from planner.workload import Workload

PREFILL_SHARES = (1 / 8, 1 / 5, 1 / 4, 1 / 3, 2 / 5, 1 / 2, 3 / 5, 2 / 3, 3 / 4, 4 / 5, 7 / 8)
GOODPUT_RATIOS = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 3), (3, 2), (1, 4), (4, 1))
# A trace spans at least this many lone-request lifetimes: long enough for an overloaded fleet's queues
# to show in its attainment rather than end with the trace.
HORIZON_LIFETIMES = 50.0
# ... but no longer than this many requests take to arrive (a large fleet's trace would grow without bound).
MAX_TRACE_REQUESTS = 50_000

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Prices:
    """What one worker of each kind costs (per hour, or any unit): the same hardware costs the same."""

    prefill: float = 1.0
    decode: float = 1.0
    colocated: float = 1.0

    def of(self, fleet: FleetShape) -> float:
        return fleet.prefill * self.prefill + fleet.decode * self.decode + fleet.colocated * self.colocated


@dataclass(frozen=True)
class Evaluation:
    fleet: FleetShape
    attainment: float  # the share of requests meeting both the TTFT and the TPOT SLO
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    cost: float


@dataclass(frozen=True)
class Goal:
    slo: Slo
    attainment: float = 0.9  # the share of requests that must meet the SLO
    max_workers: int = MAX_WORKERS
    prices: Prices = Prices()

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"the attainment target is a share in (0, 1], not {self.attainment}")
        if not 2 <= self.max_workers <= MAX_WORKERS:
            raise ValueError(f"the fleet may have 2 to {MAX_WORKERS} workers at most, not {self.max_workers}")
        if not (self.slo.ttft_s > 0 and self.slo.tpot_s > 0):
            raise ValueError(f"the TTFT and TPOT SLOs must be positive, not {self.slo.ttft_s}s and {self.slo.tpot_s}s")


@dataclass(frozen=True)
class Plan:
    split: Evaluation | None  # None: no split fleet within max_workers meets the goal
    colocated: Evaluation | None
    simulations: int


def evaluate(
    profile: CostProfile,
    requests: Sequence[RequestSpec],
    fleet: FleetShape,
    slo: Slo,
    prices: Prices = Prices(),
    options: RoutingOptions | None = None,
) -> Evaluation:
    return summarize(simulate(profile, requests, fleet, options), fleet, slo, prices.of(fleet))


def summarize(outcomes: Sequence[RequestOutcome], fleet: FleetShape, slo: Slo, cost: float) -> Evaluation:
    ttfts = sorted(o.ttft_s for o in outcomes)
    tpots = sorted(o.tpot_s for o in outcomes)
    met = sum(1 for o in outcomes if slo.met_by(o))
    return Evaluation(
        fleet,
        met / len(outcomes),
        _quantile(ttfts, 0.5),
        _quantile(ttfts, 0.9),
        _quantile(tpots, 0.5),
        _quantile(tpots, 0.9),
        cost,
    )


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class _Candidates:
    """Evaluates fleets on one request sample, each fleet once."""

    def __init__(
        self, profile: CostProfile, requests: Sequence[RequestSpec], goal: Goal, progress: Progress | None
    ) -> None:
        self.profile, self.requests, self.goal, self.progress = profile, requests, goal, progress
        self.seen: dict[FleetShape, Evaluation] = {}

    def evaluate(self, fleet: FleetShape) -> Evaluation:
        if fleet not in self.seen:
            self.seen[fleet] = evaluate(self.profile, self.requests, fleet, self.goal.slo, self.goal.prices)
            if self.progress is not None:
                result = self.seen[fleet]
                self.progress(f"{_describe(fleet)}: {result.attainment:.1%} meet the SLO")
        return self.seen[fleet]

    def meets(self, fleet: FleetShape) -> bool:
        return self.evaluate(fleet).attainment >= self.goal.attainment


def plan(profile: CostProfile, workload: Workload, goal: Goal, progress: Progress | None = None) -> Plan:
    """The cheapest split and the cheapest colocated fleet meeting the goal under the workload."""
    workload = workload.lasting(horizon_s(profile, workload, workload.rate_per_s))
    candidates = _Candidates(profile, workload.sample(), goal, progress)
    colocated = cheapest_colocated(candidates)
    split = cheapest_split(candidates, colocated.fleet.workers if colocated else None)
    return Plan(split, colocated, len(candidates.seen))


def horizon_s(profile: CostProfile, workload: Workload, rate_per_s: float) -> float:
    """How long a trace at this rate lasts at least: HORIZON_LIFETIMES lone requests, within MAX_TRACE_REQUESTS."""
    return min(HORIZON_LIFETIMES * workload.lone_request_s(profile), MAX_TRACE_REQUESTS / rate_per_s)


def cheapest_colocated(candidates: _Candidates) -> Evaluation | None:
    count = _smallest(lambda n: candidates.meets(_colocated(n)), 1, candidates.goal.max_workers)
    return candidates.evaluate(_colocated(count)) if count is not None else None


def cheapest_split(candidates: _Candidates, hint: int | None = None) -> Evaluation | None:
    """`hint`: a fleet size to start from (the colocated answer); each prefill share then starts from the
    size the share before it needed."""
    best: Evaluation | None = None
    for share in PREFILL_SHARES:
        count = _smallest(_split_meets(candidates, share), 2, candidates.goal.max_workers, hint)
        hint = count or hint
        if count is not None:
            found = candidates.evaluate(_split(count, share))
            if best is None or (found.cost, found.fleet.workers) < (best.cost, best.fleet.workers):
                best = found
    return _walk_down(candidates, best) if best is not None else None


def _split_meets(candidates: _Candidates, prefill_share: float) -> Callable[[int], bool]:
    return lambda count: candidates.meets(_split(count, prefill_share))


def _walk_down(candidates: _Candidates, best: Evaluation) -> Evaluation:
    """Drops one prefill or one decode worker while the smaller fleet still meets the goal, the cheaper
    drop first: at the end, no fleet one worker smaller meets it."""
    while True:
        fleet = best.fleet
        smaller = [
            FleetShape(Mode.SPLIT, prefill=fleet.prefill - 1, decode=fleet.decode),
            FleetShape(Mode.SPLIT, prefill=fleet.prefill, decode=fleet.decode - 1),
        ]
        usable = [f for f in smaller if f.prefill >= 1 and f.decode >= 1 and candidates.meets(f)]
        if not usable:
            return best
        best = min((candidates.evaluate(f) for f in usable), key=lambda e: (e.cost, -e.attainment))


def _smallest(meets: Callable[[int], bool], low: int, high: int, hint: int | None = None) -> int | None:
    """The smallest count in [low, high] that meets; None if even `high` fails. From `hint` (default `low`)
    it gallops, in steps that double, down while counts meet or up while they fail, then bisects between
    the last count that failed and the first that met."""
    probe = min(max(hint or low, low), high)
    failed, met, step = low - 1, probe, 1
    if meets(probe):
        while met > low:
            probe = max(low, met - step)
            if not meets(probe):
                failed = probe
                break
            met, step = probe, step * 2
    else:
        failed = probe
        while True:
            if failed == high:
                return None
            probe = min(high, failed + step)
            if meets(probe):
                met = probe
                break
            failed, step = probe, step * 2
    while met - failed > 1:
        middle = (failed + met) // 2
        if meets(middle):
            met = middle
        else:
            failed = middle
    return met


def _colocated(count: int) -> FleetShape:
    return FleetShape(Mode.COLOCATED, colocated=count)


def _split(count: int, prefill_share: float) -> FleetShape:
    prefill = min(count - 1, max(1, round(prefill_share * count)))
    return FleetShape(Mode.SPLIT, prefill=prefill, decode=count - prefill)


def _describe(fleet: FleetShape) -> str:
    if fleet.mode is Mode.COLOCATED:
        return f"{fleet.colocated} colocated"
    return f"{fleet.prefill} prefill + {fleet.decode} decode"


# ---- goodput per worker ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Goodput:
    fleet: FleetShape
    rate_per_s: float  # the highest arrival rate at which the fleet meets the attainment target

    @property
    def per_worker(self) -> float:
        return self.rate_per_s / self.fleet.workers


def goodput(
    profile: CostProfile, workload: Workload, fleet: FleetShape, slo: Slo, attainment: float, precision: float = 0.02
) -> Goodput:
    """The highest rate (within `precision`, relative) at which the fleet meets the target; 0 when even a
    trickle misses it (the SLO is tighter than a request alone can be served)."""

    def meets(rate: float) -> bool:
        requests = workload.at_rate(rate).lasting(horizon_s(profile, workload, rate)).sample()
        return evaluate(profile, requests, fleet, slo).attainment >= attainment

    low, high = 0.0, workload.rate_per_s
    while meets(high):
        low, high = high, high * 2
    floor = high / 1024
    while low == 0.0 and high > floor:
        high /= 2
        if meets(high):
            low, high = high, high * 2
    if low == 0.0:
        return Goodput(fleet, 0.0)
    while high - low > precision * low:
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return Goodput(fleet, low)


@dataclass(frozen=True)
class GoodputComparison:
    split: Goodput  # at the prefill:decode ratio with the most goodput per worker
    colocated: Goodput

    @property
    def split_wins(self) -> bool:
        return self.split.per_worker > self.colocated.per_worker


def compare_goodput(
    profile: CostProfile,
    workload: Workload,
    slo: Slo,
    attainment: float = 0.9,
    ratios: Sequence[tuple[int, int]] = GOODPUT_RATIOS,
    colocated_workers: int = 2,
    progress: Progress | None = None,
) -> GoodputComparison:
    """Goodput per worker of split serving at its best prefill:decode ratio and of colocated serving, on the
    same hardware: the most requests per second each worker serves within the SLO."""
    best: Goodput | None = None
    for prefill, decode in ratios:
        found = goodput(profile, workload, FleetShape(Mode.SPLIT, prefill=prefill, decode=decode), slo, attainment)
        if progress is not None:
            progress(f"split {prefill}:{decode}: {found.per_worker:.3f} requests/s per worker")
        if best is None or found.per_worker > best.per_worker:
            best = found
    assert best is not None, "at least one ratio"
    colocated = goodput(profile, workload, _colocated(colocated_workers), slo, attainment)
    if progress is not None:
        progress(f"colocated x{colocated_workers}: {colocated.per_worker:.3f} requests/s per worker")
    return GoodputComparison(best, colocated)
