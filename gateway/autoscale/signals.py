"""The per-phase autoscaling signals the gateway exports: every few seconds it takes each fleet's ready
workers from the registry, their live load from the LoadBoard and the recent TTFT and TPOT of the requests
it served against its SLO targets, runs the scaling decision (gateway.autoscale.decision) and sets, per fleet (model,
role, region), the gauges a Kubernetes autoscaler reads: diptych_autoscale_desired_replicas, the signals
behind it, and the current replicas it counted.

Each gateway sees every worker's load but only its own requests' latencies; the autoscaler takes the
highest desired count over the gateways (infra/helm/diptych's prometheus-adapter rule).
"""

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Gauge

from gateway.autoscale.decision import Autoscaler, Decision, FleetKey, FleetSignals, ScalingPolicy, WorkerSignals
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry, WorkerInfo
from gateway.metrics import (
    AUTOSCALE_CURRENT_REPLICAS,
    AUTOSCALE_DESIRED_REPLICAS,
    AUTOSCALE_KV_UTILISATION,
    AUTOSCALE_QUEUE_PER_WORKER,
    AUTOSCALE_SLO_ATTAINMENT,
)

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 2.0
ATTAINMENT_WINDOW_S = 60.0  # how far back the SLO attainment looks
_KEPT_PER_FLEET = 10_000  # latencies kept per fleet and SLO at most, however busy the window


@dataclass(frozen=True)
class SloTargets:
    """What a request must meet: time to its first token, and mean time per output token after it."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be above 0 (TTFT {self.ttft_s} s, TPOT {self.tpot_s} s)")


class _Phase(Protocol):
    @property
    def worker(self) -> WorkerInfo: ...


class _Trace(Protocol):
    """Where a request's phases ran, as its trace tells (gateway.core's RequestTrace, which autoscale does not
    import)."""

    @property
    def prefill(self) -> _Phase | None: ...

    @property
    def decode(self) -> _Phase | None: ...


class _LoadReport(Protocol):
    """What the signals read of a worker's load report (worker.proto's Load: autoscale imports no protobuf)."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def prompt_tokens_pending(self) -> int: ...

    @property
    def active_sequences(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def kv_blocks_free(self) -> int: ...


def fleet_key(worker: WorkerInfo) -> FleetKey:
    return FleetKey(worker.model, worker.role, worker.region)


class RecentLatencies:
    """Each fleet's recent TTFT and TPOT, as the gateway's requests saw them: TTFT counts for the fleet that
    ran the prefill, TPOT for the one that decoded (the same one for colocated and skipped-split requests)."""

    def __init__(self, window_s: float = ATTAINMENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[tuple[FleetKey, str], deque[tuple[float, float]]] = {}

    def record_ttft(self, trace: _Trace, seconds: float) -> None:
        if trace.prefill is not None:
            self._record(fleet_key(trace.prefill.worker), "ttft", seconds)

    def record_tpot(self, trace: _Trace, seconds: float) -> None:
        phase = trace.decode or trace.prefill
        if phase is not None:
            self._record(fleet_key(phase.worker), "tpot", seconds)

    def attainment(self, key: FleetKey, slo: str, target_s: float, now: float) -> float | None:
        """The share of the window's latencies within `target_s`; None when the window holds none."""
        seen = self._seen.get((key, slo))
        if seen is None:
            return None
        while seen and now - seen[0][0] > self.window_s:
            seen.popleft()
        if not seen:
            return None
        return sum(1 for _, seconds in seen if seconds <= target_s) / len(seen)

    def _record(self, key: FleetKey, slo: str, seconds: float) -> None:
        self._seen.setdefault((key, slo), deque(maxlen=_KEPT_PER_FLEET)).append((time.monotonic(), seconds))


# Fed by the pipeline where it observes TIME_TO_FIRST_TOKEN and each stream's end, as the Prometheus metrics are.
RECENT_LATENCIES = RecentLatencies()


def worker_signals(load: _LoadReport) -> WorkerSignals:
    """A worker's signals from its live load report."""
    return WorkerSignals(
        queue_depth=load.queue_depth,
        prompt_tokens_pending=load.prompt_tokens_pending,
        active_sequences=load.active_sequences,
        kv_blocks_used=load.kv_blocks_total - load.kv_blocks_free,
        kv_blocks_total=load.kv_blocks_total,
    )


def fleet_signals(
    workers: Iterable[WorkerInfo],
    board: LoadBoard,
    latencies: RecentLatencies,
    slo: SloTargets,
    now: float,
    known: Iterable[FleetKey] = (),
) -> list[FleetSignals]:
    """One FleetSignals per fleet the registry lists or the policy names (`known`): its replicas are its
    ready workers whose live load is fresh."""
    ready: dict[FleetKey, list[WorkerSignals]] = {key: [] for key in known}
    for worker in workers:
        loads = ready.setdefault(fleet_key(worker), [])
        load = board.fresh_load(worker.id)
        if worker.state == "ready" and load is not None and not load.draining:
            loads.append(worker_signals(load))
    return [
        FleetSignals(
            key,
            tuple(loads),
            ttft_attainment=latencies.attainment(key, "ttft", slo.ttft_s, now),
            tpot_attainment=latencies.attainment(key, "tpot", slo.tpot_s, now),
        )
        for key, loads in sorted(ready.items())
    ]


class AutoscaleSignals:
    """Runs the scaling decision every PUBLISH_INTERVAL_S and exports it with its signals."""

    def __init__(
        self,
        registry: Registry,
        board: LoadBoard,
        policy: ScalingPolicy,
        slo: SloTargets,
        latencies: RecentLatencies = RECENT_LATENCIES,
    ) -> None:
        self._registry, self._board, self._slo, self._latencies = registry, board, slo, latencies
        self._autoscaler = Autoscaler(policy)
        self._published: set[FleetKey] = set()
        self._last_desired: dict[FleetKey, int] = {}  # logged when it changes

    def publish(self, now: float | None = None) -> list[Decision]:
        now = time.monotonic() if now is None else now
        fleets = fleet_signals(
            self._registry.workers, self._board, self._latencies, self._slo, now, self._autoscaler.policy.fleets
        )
        decisions = self._autoscaler.decide(fleets, now)
        for fleet, decision in zip(fleets, decisions, strict=True):
            _export(fleet, decision)
            if decision.desired != self._last_desired.get(fleet.key, decision.current):
                log.info(
                    "autoscale %s: %d -> %d replicas (%s)",
                    fleet.key,
                    decision.current,
                    decision.desired,
                    decision.reason,
                )
        for gone in self._published - {fleet.key for fleet in fleets}:
            _forget(gone)
        self._published = {fleet.key for fleet in fleets}
        self._last_desired = {d.key: d.desired for d in decisions}
        return decisions

    async def publish_forever(self) -> None:
        while True:
            try:
                self.publish()
            except Exception as error:  # keep exporting whatever one round ran into
                log.warning("computing the autoscaling signals failed: %r", error)
            await asyncio.sleep(PUBLISH_INTERVAL_S)


def _export(fleet: FleetSignals, decision: Decision) -> None:
    labels = (fleet.key.model, fleet.key.role, fleet.key.region)
    AUTOSCALE_DESIRED_REPLICAS.labels(*labels).set(decision.desired)
    AUTOSCALE_CURRENT_REPLICAS.labels(*labels).set(decision.current)
    AUTOSCALE_QUEUE_PER_WORKER.labels(*labels).set(fleet.queue_per_worker)
    AUTOSCALE_KV_UTILISATION.labels(*labels).set(fleet.kv_utilisation)
    for slo, value in (("ttft", fleet.ttft_attainment), ("tpot", fleet.tpot_attainment)):
        if value is None:
            _remove(AUTOSCALE_SLO_ATTAINMENT, *labels, slo)
        else:
            AUTOSCALE_SLO_ATTAINMENT.labels(*labels, slo).set(value)


def _forget(key: FleetKey) -> None:
    labels = (key.model, key.role, key.region)
    for gauge in (
        AUTOSCALE_DESIRED_REPLICAS,
        AUTOSCALE_CURRENT_REPLICAS,
        AUTOSCALE_QUEUE_PER_WORKER,
        AUTOSCALE_KV_UTILISATION,
    ):
        _remove(gauge, *labels)
    for slo in ("ttft", "tpot"):
        _remove(AUTOSCALE_SLO_ATTAINMENT, *labels, slo)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set
        gauge.remove(*labels)
