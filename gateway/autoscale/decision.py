"""The one scaling decision: from a snapshot of each fleet's live per-phase signals to the replicas it should
run, with the reason. The gateway exports it (gateway/autoscale/signals.py) for a Kubernetes autoscaler; the
tests replay recorded signals through it.

Prefill fleets scale on waiting requests and prompt tokens still to compute per worker; decode fleets on
waiting requests, KV cache utilisation and running sequences against the engine's max_running; colocated
fleets on all of them. Every fleet also scales on the SLO attainment of the requests it served: TTFT counts
for the fleet that produced the first token (the prefill fleet, or the decode fleet for a prompt short enough
to skip the split), TPOT for the fleet that decoded. A signal over its target scales up at once, in proportion
(as a Kubernetes HPA would), by at most `max_step_up` workers. Scale-down needs every signal low (under
`low_share` of its target, attainment at or over the floor) for the whole `scale_down_window_s`, then steps
down by at most `max_step_down`, and never below the fleet's minimum or the planner's baseline.

`decide` is pure: the hysteresis lives in the `low_since` map it takes and returns; `Autoscaler` keeps it.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, order=True)
class FleetKey:
    model: str
    role: str  # prefill, decode or colocated
    region: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"a fleet's role is one of {', '.join(ROLES)}, not {self.role!r}")

    def __str__(self) -> str:
        return f"{self.model}/{self.role}/{self.region or '-'}"


@dataclass(frozen=True)
class WorkerSignals:
    """One ready worker's live load, as its load report gives it."""

    queue_depth: int  # requests waiting, not yet running
    prompt_tokens_pending: int  # prompt tokens of its queued and running requests not computed yet
    active_sequences: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(frozen=True)
class FleetSignals:
    key: FleetKey
    workers: tuple[WorkerSignals, ...]  # the ready workers: the fleet's current replicas
    ttft_attainment: float | None = None  # share of recent requests meeting the TTFT target; None: none seen
    tpot_attainment: float | None = None

    @property
    def replicas(self) -> int:
        return len(self.workers)

    @property
    def queue_per_worker(self) -> float:
        return _mean(w.queue_depth for w in self.workers)

    @property
    def pending_tokens_per_worker(self) -> float:
        return _mean(w.prompt_tokens_pending for w in self.workers)

    @property
    def running_per_worker(self) -> float:
        return _mean(w.active_sequences for w in self.workers)

    @property
    def kv_utilisation(self) -> float:
        total = sum(w.kv_blocks_total for w in self.workers)
        return sum(w.kv_blocks_used for w in self.workers) / total if total else 0.0


@dataclass(frozen=True)
class Targets:
    queue_per_worker: float = 4.0  # waiting requests per prefill or colocated worker
    pending_tokens_per_worker: float = 8192.0  # prompt tokens still to compute per prefill or colocated worker
    kv_utilisation: float = 0.8  # share of the KV blocks in use on decode or colocated workers
    running_share: float = 0.9  # running sequences per decode or colocated worker, as a share of max_running
    attainment_floor: float = 0.9  # least share of recent requests meeting the phase's SLO target
    low_share: float = 0.5  # a load signal under this share of its target counts as low

    def __post_init__(self) -> None:
        for name in ("queue_per_worker", "pending_tokens_per_worker", "kv_utilisation", "running_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"targets.{name} must be above 0, not {getattr(self, name)!r}")
        for name in ("attainment_floor", "low_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"targets.{name} must lie in [0, 1], not {getattr(self, name)!r}")


@dataclass(frozen=True)
class FleetLimits:
    min_replicas: int = 1
    max_replicas: int = 16
    baseline: int = 0  # the planner's recommended replicas: never scaled below
    max_running: int = 64  # the workers' --max-running

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.baseline < 0:
            raise ValueError(f"min_replicas and baseline must be 0 or more, not {self.min_replicas}, {self.baseline}")
        if self.max_replicas < max(self.min_replicas, self.baseline, 1):
            raise ValueError(
                f"max_replicas {self.max_replicas} is below min_replicas {self.min_replicas} or the baseline "
                f"{self.baseline}"
            )
        if self.max_running < 1:
            raise ValueError(f"max_running must be 1 or more, not {self.max_running}")

    @property
    def floor(self) -> int:
        return max(self.min_replicas, self.baseline)


@dataclass(frozen=True)
class ScalingPolicy:
    targets: Targets = Targets()
    defaults: FleetLimits = FleetLimits()
    fleets: Mapping[FleetKey, FleetLimits] = field(default_factory=dict)  # per-fleet limits and baselines
    scale_down_window_s: float = 300.0
    max_step_up: int = 4
    max_step_down: int = 1

    def __post_init__(self) -> None:
        if self.scale_down_window_s < 0:
            raise ValueError(f"scale_down_window_s must be 0 or more, not {self.scale_down_window_s}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError(
                f"max_step_up and max_step_down must be 1 or more ({self.max_step_up}, {self.max_step_down})"
            )

    def limits(self, key: FleetKey) -> FleetLimits:
        return self.fleets.get(key, self.defaults)


@dataclass(frozen=True)
class Decision:
    key: FleetKey
    current: int
    desired: int
    reason: str


@dataclass(frozen=True)
class _Pressure:
    """One signal against its target: ratio > 1 is over it."""

    ratio: float
    text: str  # the signal, e.g. "queue 12.0 per worker"
    target: str  # its target, e.g. "4"


def decide(
    fleets: list[FleetSignals], policy: ScalingPolicy, low_since: Mapping[FleetKey, float], now: float
) -> tuple[list[Decision], dict[FleetKey, float]]:
    """Each fleet's decision, and the updated map of since when each fleet's signals have been low."""
    decisions, still_low = [], {}
    for fleet in fleets:
        decision, since = decide_fleet(fleet, policy, low_since.get(fleet.key), now)
        decisions.append(decision)
        if since is not None:
            still_low[fleet.key] = since
    return decisions, still_low


def decide_fleet(
    fleet: FleetSignals, policy: ScalingPolicy, low_since: float | None, now: float
) -> tuple[Decision, float | None]:
    limits, current = policy.limits(fleet.key), fleet.replicas
    if current < limits.floor:
        reason = f"{current} ready < floor {limits.floor} (min {limits.min_replicas}, baseline {limits.baseline})"
        return Decision(fleet.key, current, limits.floor, reason), None
    loads = load_pressures(fleet, policy.targets, limits)
    missed = missed_attainment(fleet, policy.targets)
    over = [p for p in loads if p.ratio > 1]
    if over or missed:
        return _scale_up(fleet, policy, limits, over, missed), None
    if not all(p.ratio < policy.targets.low_share for p in loads):
        return Decision(fleet.key, current, current, "steady: " + _describe(loads)), None
    return _maybe_scale_down(fleet, policy, limits, loads, low_since, now)


def load_pressures(fleet: FleetSignals, targets: Targets, limits: FleetLimits) -> list[_Pressure]:
    """The phase's load signals against their targets: waiting requests for every role, pending prompt
    tokens for prefill, KV and running sequences for decode, all four for colocated."""
    queue, target = fleet.queue_per_worker, targets.queue_per_worker
    pressures = [_Pressure(queue / target, f"queue {queue:.1f} per worker", f"{target:g}")]
    if fleet.key.role in ("prefill", "colocated"):
        pending, target = fleet.pending_tokens_per_worker, targets.pending_tokens_per_worker
        pressures.append(_Pressure(pending / target, f"pending prompt tokens {pending:.0f} per worker", f"{target:g}"))
    if fleet.key.role in ("decode", "colocated"):
        kv, target = fleet.kv_utilisation, targets.kv_utilisation
        pressures.append(_Pressure(kv / target, f"KV utilisation {kv:.2f}", f"{target:.2f}"))
        running, share = fleet.running_per_worker, targets.running_share
        target = share * limits.max_running
        of_max = f"{target:g} ({share:g} of max_running {limits.max_running})"
        pressures.append(_Pressure(running / target, f"running {running:.1f} per worker", of_max))
    return pressures


def missed_attainment(fleet: FleetSignals, targets: Targets) -> list[str]:
    """The SLOs whose recent attainment on the fleet's own requests is under the floor."""
    missed = []
    for slo, value in (("TTFT", fleet.ttft_attainment), ("TPOT", fleet.tpot_attainment)):
        if value is not None and value < targets.attainment_floor:
            missed.append(f"{slo} attainment {value:.2f} < {targets.attainment_floor:.2f}")
    return missed


def _scale_up(
    fleet: FleetSignals, policy: ScalingPolicy, limits: FleetLimits, over: list[_Pressure], missed: list[str]
) -> Decision:
    current = fleet.replicas
    wanted = current + 1 if missed else current
    if over:
        wanted = max(wanted, math.ceil(current * max(p.ratio for p in over)))
    desired = min(wanted, current + policy.max_step_up, limits.max_replicas)
    reasons = [f"{p.text} > {p.target}" for p in over] + missed
    if desired == limits.max_replicas and wanted > desired:
        reasons.append(f"capped at max {limits.max_replicas}")
    return Decision(fleet.key, current, max(desired, current), "; ".join(reasons))


def _maybe_scale_down(
    fleet: FleetSignals,
    policy: ScalingPolicy,
    limits: FleetLimits,
    loads: list[_Pressure],
    low_since: float | None,
    now: float,
) -> tuple[Decision, float | None]:
    current = fleet.replicas
    since = now if low_since is None else low_since
    idle = "idle: " + _describe(loads)
    if current <= limits.floor:
        return Decision(fleet.key, current, current, f"{idle}; at floor {limits.floor}"), since
    if now - since < policy.scale_down_window_s:
        waited = f"low for {now - since:.0f} s of the {policy.scale_down_window_s:.0f} s window"
        return Decision(fleet.key, current, current, f"{idle}; {waited}"), since
    heaviest = max((p.ratio for p in loads), default=0.0)
    enough = math.ceil(current * heaviest / policy.targets.low_share)
    desired = max(limits.floor, current - policy.max_step_down, min(enough, current - 1))
    # the window starts again: each further step down needs the signals to stay low once more
    return Decision(
        fleet.key, current, desired, f"{idle}; low for the whole {policy.scale_down_window_s:.0f} s window"
    ), now


def _describe(loads: list[_Pressure]) -> str:
    return ", ".join(p.text for p in loads)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


class Autoscaler:
    """`decide` with its hysteresis kept between calls."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self._low_since: dict[FleetKey, float] = {}

    def decide(self, fleets: list[FleetSignals], now: float) -> list[Decision]:
        decisions, self._low_since = decide(fleets, self.policy, self._low_since, now)
        return decisions
