"""The gateway's autoscaling signals: which fleet a request's latencies count for, the attainment window, and
the gauges published per fleet from the registry and the live load board."""

import time
from datetime import UTC, datetime

from prometheus_client import REGISTRY

from diptych_common.proto.v1 import worker_pb2
from gateway.autoscale.decision import FleetKey, FleetLimits, ScalingPolicy
from gateway.autoscale.signals import AutoscaleSignals, RecentLatencies, SloTargets
from gateway.core.trace import PhaseRecord, RequestTrace
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry, WorkerInfo


def worker(worker_id: str, role: str, model: str, region: str = "eu", state: str = "ready") -> WorkerInfo:
    return WorkerInfo(worker_id, role, model, region, f"127.0.0.1:{hash(worker_id) % 1000 + 41000}", state, 0, 0)


def trace(prefill: WorkerInfo, decode: WorkerInfo | None) -> RequestTrace:
    now = datetime.now(UTC)
    return RequestTrace(
        prefill=PhaseRecord(prefill, started_at=now), decode=PhaseRecord(decode, started_at=now) if decode else None
    )


def key(w: WorkerInfo) -> FleetKey:
    return FleetKey(w.model, w.role, w.region)


def test_first_tokens_count_for_the_prefilling_fleet_and_token_pace_for_the_decoding_one():
    latencies = RecentLatencies()
    p, d, c = worker("p", "prefill", "a"), worker("d", "decode", "a"), worker("c", "colocated", "a")
    split = trace(p, d)
    latencies.record_ttft(split, 0.5)
    latencies.record_ttft(split, 3.0)
    latencies.record_tpot(split, 0.3)
    now = time.monotonic()
    assert latencies.attainment(key(p), "ttft", 1.0, now) == 0.5
    assert latencies.attainment(key(p), "tpot", 0.2, now) is None
    assert latencies.attainment(key(d), "tpot", 0.2, now) == 0.0
    assert latencies.attainment(key(d), "ttft", 1.0, now) is None
    colocated = trace(c, None)
    latencies.record_ttft(colocated, 0.1)
    latencies.record_tpot(colocated, 0.1)
    assert latencies.attainment(key(c), "ttft", 1.0, now) == latencies.attainment(key(c), "tpot", 0.2, now) == 1.0


def test_attainment_forgets_latencies_older_than_its_window():
    latencies = RecentLatencies(window_s=60.0)
    p = worker("p", "prefill", "b")
    latencies.record_ttft(trace(p, None), 5.0)
    assert latencies.attainment(key(p), "ttft", 1.0, time.monotonic() + 30) == 0.0
    assert latencies.attainment(key(p), "ttft", 1.0, time.monotonic() + 61) is None


def _value(name: str, w: WorkerInfo, **extra: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": w.model, "role": w.role, "region": w.region, **extra})


def test_each_fleet_s_decision_and_signals_are_published_and_a_fleet_that_left_is_forgotten():
    p1, p2, d1 = worker("p1", "prefill", "c"), worker("p2", "prefill", "c"), worker("d1", "decode", "c")
    stale = worker("p3", "prefill", "c")
    registry = Registry(control_plane=None)
    registry.workers = [p1, p2, d1, stale]
    board = LoadBoard(Channels())
    board.report(p1, worker_pb2.Load(worker_id="p1", queue_depth=12, kv_blocks_total=10, kv_blocks_free=10))
    board.report(p2, worker_pb2.Load(worker_id="p2", queue_depth=4, kv_blocks_total=10, kv_blocks_free=10))
    board.report(d1, worker_pb2.Load(worker_id="d1", kv_blocks_total=100, kv_blocks_free=30))
    board.mark_broken("p3")  # its stream broke: not a replica the fleet can count on
    latencies = RecentLatencies()
    latencies.record_ttft(trace(p1, d1), 9.0)
    policy = ScalingPolicy(fleets={FleetKey("c", "colocated", "eu"): FleetLimits(baseline=2)})
    signals = AutoscaleSignals(registry, board, policy, SloTargets(ttft_s=1.0, tpot_s=0.1), latencies)

    signals.publish()
    assert _value("diptych_autoscale_current_replicas", p1) == 2
    assert _value("diptych_autoscale_queue_per_worker", p1) == 8.0
    assert _value("diptych_autoscale_desired_replicas", p1) == 4  # 8 waiting per worker against 4
    assert _value("diptych_autoscale_slo_attainment", p1, slo="ttft") == 0.0
    assert _value("diptych_autoscale_slo_attainment", p1, slo="tpot") is None
    assert _value("diptych_autoscale_kv_utilisation", d1) == 0.7
    assert _value("diptych_autoscale_desired_replicas", d1) == 1
    colocated = worker("x", "colocated", "c")  # named by the policy, no worker yet: brought to its baseline
    assert _value("diptych_autoscale_current_replicas", colocated) == 0
    assert _value("diptych_autoscale_desired_replicas", colocated) == 2

    registry.workers = [d1]
    signals.publish()
    assert _value("diptych_autoscale_desired_replicas", p1) is None
    assert _value("diptych_autoscale_slo_attainment", p1, slo="ttft") is None
    assert _value("diptych_autoscale_desired_replicas", d1) == 1
