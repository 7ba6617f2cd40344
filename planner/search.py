"""The cheapest fleet that meets an SLO, and the goodput per worker of split and colocated serving.

Every candidate fleet serves the same sampled requests (one seed), so two candidates differ only by their
shape. The share of requests meeting the SLO grows with workers (within the noise of routing), which lets
the search bisect.

The default search (`search="narrow"`) starts from the queueing model's answer (`planner.analytic`, no
simulation) and simulates only near it: colocated, the count galloping from the model's (down while fleets
meet, up while they fail) then bisecting; split, first a fleet that meets (the model's, grown until it
does), then the smallest decode count at its prefill count, then the smallest prefill count at that decode
count, then the walk down. Counts are found to within `PRECISION` of the fleet (one worker below 50): the
answer meets the goal and a fleet smaller by that many workers (of either kind) does not.

The full search (`search="full"`, the planner's before it had a model) bisects colocated counts from one
worker up and split counts at each prefill share of `PREFILL_SHARES` (starting near the size found last),
then walks down one worker at a time: exact, and slow past a few hundred workers.

Rate scaling: when a trace capped at `MAX_TRACE_REQUESTS` would span fewer than `HORIZON_LIFETIMES`
lone-request lifetimes, every fleet's attainment is a transient. The plan is then made for the rate R / k,
k the smallest integer whose trace spans the horizon within the cap, and its counts multiplied by k: a
load-balanced fleet of k*N workers at k*R serves as N workers at R do, slightly better through pooling, so
the scaled answer errs on the side of more workers.
"""

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from planner.analytic import FleetModel, Prediction
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
PRECISION = 0.02  # the narrow search's counts: within 2% of the fleet (exact below 50 workers)

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
    ttft_p99_s: float
    tpot_p99_s: float


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
    # the queueing model's first cut (None: no fleet within its limit meets the goal, or a full search)
    model_split: Prediction | None = None
    model_colocated: Prediction | None = None
    # the plan was made for the workload's rate / rate_scale and its counts multiplied by rate_scale
    rate_scale: int = 1
    planned_rate_per_s: float | None = None  # the rate simulated: the workload's / rate_scale


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
        _quantile(ttfts, 0.99),
        _quantile(tpots, 0.99),
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
            if self.progress is not None:
                self.progress(f"trying {_describe(fleet)} on {len(self.requests)} requests")
            started = time.monotonic()
            self.seen[fleet] = evaluate(self.profile, self.requests, fleet, self.goal.slo, self.goal.prices)
            if self.progress is not None:
                result = self.seen[fleet]
                self.progress(
                    f"simulated {_describe(fleet)}: {result.attainment:.1%} meet the SLO "
                    f"({time.monotonic() - started:.1f} s)"
                )
        return self.seen[fleet]

    def meets(self, fleet: FleetShape) -> bool:
        return self.evaluate(fleet).attainment >= self.goal.attainment


def plan(
    profile: CostProfile,
    workload: Workload,
    goal: Goal,
    progress: Progress | None = None,
    search: Literal["narrow", "full"] = "narrow",
    rate_scale: int | None = None,
) -> Plan:
    """The cheapest split and the cheapest colocated fleet meeting the goal under the workload. `rate_scale`:
    plan for the rate / k and multiply the counts by k (default: `rate_scale_for`, 1 when the trace fits)."""
    scale = rate_scale_for(profile, workload) if rate_scale is None else rate_scale
    if scale < 1:
        raise ValueError(f"the rate scale is a whole number of fleets, 1 or more, not {scale}")
    if scale == 1:
        return _plan_at_rate(profile, workload, goal, progress, search)
    planned = workload.at_rate(workload.rate_per_s / scale)
    if progress is not None:
        lone_s = workload.lone_request_s(profile)
        progress(
            f"rate scaling by {scale}: a trace at {workload.rate_per_s:g} requests/s would span "
            f"{_span_s(profile, workload) / lone_s:.1f} lone-request lifetimes, at {planned.rate_per_s:g} requests/s "
            f"({workload.rate_per_s:g} / {scale}) {_span_s(profile, planned) / lone_s:.1f}; planning that rate and "
            f"multiplying its counts by {scale}"
        )
    scaled_goal = dataclasses.replace(goal, max_workers=max(2, goal.max_workers // scale))
    found = _plan_at_rate(profile, planned, scaled_goal, progress, search)
    return Plan(
        _scaled_evaluation(found.split, scale, goal),
        _scaled_evaluation(found.colocated, scale, goal),
        found.simulations,
        _scaled_prediction(found.model_split, scale),
        _scaled_prediction(found.model_colocated, scale),
        rate_scale=scale,
        planned_rate_per_s=planned.rate_per_s,
    )


def rate_scale_for(profile: CostProfile, workload: Workload) -> int:
    """The smallest k for which the trace at the workload's rate / k spans HORIZON_LIFETIMES lone-request
    lifetimes within MAX_TRACE_REQUESTS (or the workload's own larger request count): 1 when it fits."""
    needed = HORIZON_LIFETIMES * workload.lone_request_s(profile) * workload.rate_per_s
    allowed = max(MAX_TRACE_REQUESTS, workload.requests)
    return max(1, math.ceil(needed / allowed - 1e-9))


def _span_s(profile: CostProfile, workload: Workload) -> float:
    """How long the arrivals of the trace the search simulates for the workload last."""
    return workload.lasting(horizon_s(profile, workload, workload.rate_per_s)).requests / workload.rate_per_s


def scaled_fleet(fleet: FleetShape, scale: int) -> FleetShape:
    return FleetShape(fleet.mode, fleet.prefill * scale, fleet.decode * scale, fleet.colocated * scale)


def _scaled_evaluation(found: Evaluation | None, scale: int, goal: Goal) -> Evaluation | None:
    """The answer for rate / scale as the answer for the rate; None when the scaled fleet is too large."""
    if found is None:
        return None
    fleet = scaled_fleet(found.fleet, scale)
    if fleet.workers > goal.max_workers:
        return None
    return dataclasses.replace(found, fleet=fleet, cost=goal.prices.of(fleet))


def _scaled_prediction(found: Prediction | None, scale: int) -> Prediction | None:
    return None if found is None else dataclasses.replace(found, fleet=scaled_fleet(found.fleet, scale))


def _plan_at_rate(
    profile: CostProfile, workload: Workload, goal: Goal, progress: Progress | None, search: Literal["narrow", "full"]
) -> Plan:
    workload = workload.lasting(horizon_s(profile, workload, workload.rate_per_s))
    candidates = _Candidates(profile, workload.sample(), goal, progress)
    if search == "full":
        colocated = cheapest_colocated(candidates)
        split = cheapest_split(candidates, colocated.fleet.workers if colocated else None)
        return Plan(split, colocated, len(candidates.seen))
    model = FleetModel(profile, list(candidates.requests), goal.slo, workload.seed)
    model_colocated = model.smallest_colocated(goal.attainment)
    model_split = model.smallest_split(goal.attainment)
    if progress is not None:
        progress(f"queueing model: split {_predicted(model_split)}, colocated {_predicted(model_colocated)}")
    colocated = colocated_near(candidates, model_colocated.fleet if model_colocated else None)
    split = split_near(candidates, model_split.fleet if model_split else None)
    return Plan(split, colocated, len(candidates.seen), model_split, model_colocated)


def _predicted(found: Prediction | None) -> str:
    return "none" if found is None else f"{_describe(found.fleet)} ({found.attainment:.1%} predicted to meet the SLO)"


def colocated_near(candidates: _Candidates, cut: FleetShape | None) -> Evaluation | None:
    """The smallest colocated count meeting the goal, searched from the model's `cut` (None: from the
    largest fleet allowed, which then most likely fails)."""
    high = candidates.goal.max_workers
    hint = cut.colocated if cut is not None else high
    count = _smallest(lambda n: candidates.meets(_colocated(n)), 1, high, hint, PRECISION)
    return candidates.evaluate(_colocated(count)) if count is not None else None


def split_near(candidates: _Candidates, cut: FleetShape | None) -> Evaluation | None:
    """The cheapest split fleet near the model's `cut`: a fleet that meets (the cut, both kinds grown until
    it does), the smallest decode count at its prefill count, the smallest prefill count at that one, then
    the walk down."""
    high = candidates.goal.max_workers
    prefill, decode = (cut.prefill, cut.decode) if cut is not None else (max(1, high // 8), high - max(1, high // 8))
    if prefill + decode > high:  # the model wants more than allowed: the largest fleet of its proportion
        prefill = min(high - 1, max(1, round(prefill * high / (prefill + decode))))
        decode = high - prefill
    meeting = _meeting_split(candidates, prefill, decode)
    if meeting is None:
        return None
    room_prefill, room_decode = meeting
    # both kinds to within the same number of workers: PRECISION of the whole fleet
    precision = PRECISION * (room_prefill + room_decode) / room_decode
    decode = _smallest(_decode_meets(candidates, room_prefill), 1, room_decode, decode, precision) or room_decode
    precision = PRECISION * (room_prefill + decode) / room_prefill
    prefill = _smallest(_prefill_meets(candidates, decode), 1, room_prefill, prefill, precision) or room_prefill
    return _walk_down(candidates, candidates.evaluate(_split_of(prefill, decode)), PRECISION)


def _meeting_split(candidates: _Candidates, prefill: int, decode: int) -> tuple[int, int] | None:
    """A split fleet that meets, from (prefill, decode) grown by a margin that doubles while it fails;
    None when the largest fleet allowed in that proportion fails."""
    high, margin = candidates.goal.max_workers, 0.0
    while True:
        grown_prefill = prefill + math.ceil(margin * prefill)
        grown_decode = decode + math.ceil(margin * decode)
        if grown_prefill + grown_decode > high:
            grown_prefill = min(high - 1, max(1, round(grown_prefill * high / (grown_prefill + grown_decode))))
            grown_decode = high - grown_prefill
        if candidates.meets(_split_of(grown_prefill, grown_decode)):
            return grown_prefill, grown_decode
        if grown_prefill + grown_decode >= high:
            return None
        margin = max(4 * PRECISION, 2 * margin, 1 / min(prefill, decode))  # the first growth adds one at least


def _decode_meets(candidates: _Candidates, prefill: int) -> Callable[[int], bool]:
    return lambda decode: candidates.meets(_split_of(prefill, decode))


def _prefill_meets(candidates: _Candidates, decode: int) -> Callable[[int], bool]:
    return lambda prefill: candidates.meets(_split_of(prefill, decode))


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


def _walk_down(candidates: _Candidates, best: Evaluation, precision: float = 0.0) -> Evaluation:
    """Drops prefill or decode workers (`_tolerance` of the fleet's count: one at precision 0) while the
    smaller fleet still meets the goal, the cheaper drop first: at the end, no fleet that much smaller
    meets it."""
    while True:
        fleet = best.fleet
        drop = _tolerance(fleet.workers, precision)
        smaller = [
            _split_of(max(1, fleet.prefill - drop), fleet.decode),
            _split_of(fleet.prefill, max(1, fleet.decode - drop)),
        ]
        smaller = [f for f in smaller if f != fleet]
        usable = [f for f in smaller if f.prefill >= 1 and f.decode >= 1 and candidates.meets(f)]
        if not usable:
            return best
        best = min((candidates.evaluate(f) for f in usable), key=lambda e: (e.cost, -e.attainment))


def _smallest(
    meets: Callable[[int], bool], low: int, high: int, hint: int | None = None, precision: float = 0.0
) -> int | None:
    """The smallest count in [low, high] that meets; None if even `high` fails. From `hint` (default `low`)
    it gallops, in steps that double, down while counts meet or up while they fail, then bisects between
    the last count that failed and the first that met. With a `precision`, it stops once the two are
    within `_tolerance` of the count that met (the first step is that tolerance too)."""
    probe = min(max(hint or low, low), high)
    failed, met, step = low - 1, probe, _tolerance(probe, precision)
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
    while met - failed > _tolerance(met, precision):
        middle = (failed + met) // 2
        if meets(middle):
            met = middle
        else:
            failed = middle
    return met


def _tolerance(count: int, precision: float) -> int:
    return max(1, int(precision * count))


def _colocated(count: int) -> FleetShape:
    return FleetShape(Mode.COLOCATED, colocated=count)


def _split(count: int, prefill_share: float) -> FleetShape:
    prefill = min(count - 1, max(1, round(prefill_share * count)))
    return FleetShape(Mode.SPLIT, prefill=prefill, decode=count - prefill)


def _split_of(prefill: int, decode: int) -> FleetShape:
    return FleetShape(Mode.SPLIT, prefill=prefill, decode=decode)


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
