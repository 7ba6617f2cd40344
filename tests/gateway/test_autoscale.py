"""The scaling decision (gateway.autoscale.decision), driven by the signals of a real split stack recorded under bounded
bursts (tests/gateway/recorded_signals/, written by `python -m bench.record_autoscale_signals`): each recorded load
report becomes a worker's signals, the gateway's recorded SLO attainment the fleet's, the recorded time the
clock. Then the rules one by one on plain inputs, and the policy file's checks."""

import json
import math
from pathlib import Path

import pytest

from gateway.autoscale.decision import (
    Autoscaler,
    Decision,
    FleetKey,
    FleetLimits,
    FleetSignals,
    ScalingPolicy,
    Targets,
    WorkerSignals,
    decide_fleet,
)
from gateway.autoscale.policy_file import PolicyError, load_policy, policy_from_json

RECORDED = Path(__file__).parent / "recorded_signals"
FLOOR = Targets().attainment_floor


def _recording(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def _keys(recording: dict) -> dict[str, FleetKey]:
    """Worker name -> its fleet."""
    return {name: FleetKey(w["model"], w["role"], w["region"]) for name, w in recording["workers"].items()}


def _policy(recording: dict, **changes) -> ScalingPolicy:
    """The default policy, with each fleet's max_running as its workers ran."""
    limits = {
        key: FleetLimits(max_running=recording["workers"][name]["max_running"])
        for name, key in _keys(recording).items()
    }
    return ScalingPolicy(fleets=limits, **changes)


def _worker(load: dict) -> WorkerSignals:
    return WorkerSignals(
        queue_depth=load["queue_depth"],
        prompt_tokens_pending=load["prompt_tokens_pending"],
        active_sequences=load["active_sequences"],
        kv_blocks_used=load["kv_blocks_total"] - load["kv_blocks_free"],
        kv_blocks_total=load["kv_blocks_total"],
    )


def _fleets(recording: dict, sample: dict, replicas: dict[FleetKey, int]) -> list[FleetSignals]:
    """A sample as the decision's input: each fleet of `replicas[key]` workers, each reporting the recorded
    worker's load, with the gateway's recorded attainment."""
    attainment = sample["gateway"].get("slo_attainment", {})
    fleets = []
    for name, key in _keys(recording).items():
        fleets.append(
            FleetSignals(
                key,
                (_worker(sample["loads"][name]),) * replicas[key],
                ttft_attainment=attainment.get(f"{key.role}/ttft"),
                tpot_attainment=attainment.get(f"{key.role}/tpot"),
            )
        )
    return fleets


def _replay(recording: dict, policy: ScalingPolicy, replicas: int = 1, follow: bool = False, rounds: int = 1):
    """(time, {role: decision}) per sample. With `follow`, each decision is carried out before the next sample
    (the fleet then has the desired replicas); `rounds` plays the recording that many times in a row."""
    scaler, keys = Autoscaler(policy), _keys(recording)
    current = dict.fromkeys(keys.values(), replicas)
    duration = recording["samples"][-1]["t"] + 0.25
    timeline = []
    for round_ in range(rounds):
        for sample in recording["samples"]:
            now = round_ * duration + sample["t"]
            decisions = {d.key.role: d for d in scaler.decide(_fleets(recording, sample, current), now)}
            timeline.append((now, decisions))
            if follow:
                current = {d.key: d.desired for d in decisions.values()}
    return timeline


def _loads(sample: dict, role: str) -> dict:
    (load,) = [load for name, load in sample["loads"].items() if name.startswith(role)]
    return load


# ---- replayed recordings ----


def test_a_prefill_heavy_burst_scales_the_prefill_fleet_up_and_leaves_decode_alone():
    recording = _recording("prefill_heavy")
    timeline = _replay(recording, _policy(recording))
    # before the gateway had any request's latency: the load alone
    by_load = [
        d["prefill"] for _, d in timeline if d["prefill"].desired > 1 and "attainment" not in d["prefill"].reason
    ]
    assert by_load, "the prefill queue never scaled the prefill fleet"
    assert "queue" in by_load[0].reason and "pending prompt tokens" in by_load[0].reason
    assert all(d["decode"].desired == 1 for _, d in timeline), [d["decode"].reason for _, d in timeline]


def test_a_decode_heavy_burst_scales_the_decode_fleet_up_and_leaves_prefill_alone():
    recording = _recording("decode_heavy")
    timeline = _replay(recording, _policy(recording))
    by_load = [d["decode"] for _, d in timeline if d["decode"].desired > 1 and "attainment" not in d["decode"].reason]
    assert by_load, "the decode load never scaled the decode fleet"
    assert any("running" in d.reason for d in by_load)
    assert all(d["prefill"].desired == 1 for _, d in timeline), [d["prefill"].reason for _, d in timeline]


def test_an_idle_fleet_steps_down_to_its_minimum_only_after_the_window():
    recording = _recording("idle")
    window = 2.0
    timeline = _replay(recording, _policy(recording, scale_down_window_s=window), replicas=3, follow=True, rounds=3)
    prefill = [(now, d["prefill"]) for now, d in timeline]
    assert all(d.desired == 3 for now, d in prefill if now < window), "scaled down before the window"
    steps = [(now, d.current, d.desired) for now, d in prefill if d.desired != d.current]
    assert [(c, w) for _, c, w in steps] == [(3, 2), (2, 1)], steps
    assert steps[1][0] - steps[0][0] >= window, "the second step came before the signals stayed low a window again"
    assert prefill[-1][1].desired == 1 and "at floor 1" in prefill[-1][1].reason


def test_an_idle_fleet_never_goes_below_the_planner_s_baseline():
    recording = _recording("idle")
    prefill, decode = sorted(set(_keys(recording).values()), key=lambda k: k.role != "prefill")
    policy = ScalingPolicy(
        fleets={prefill: FleetLimits(baseline=2), decode: FleetLimits(max_running=16)}, scale_down_window_s=1.0
    )
    timeline = _replay(recording, policy, replicas=4, follow=True, rounds=4)
    assert timeline[-1][1]["prefill"].desired == 2
    assert timeline[-1][1]["decode"].desired == 1
    assert min(d["prefill"].desired for _, d in timeline) == 2


def test_slo_attainment_under_the_floor_scales_the_phase_that_missed_it_even_with_a_short_queue():
    for name, missed in (("prefill_heavy", "prefill"), ("decode_heavy", "decode")):
        recording = _recording(name)
        other = {"prefill": "decode", "decode": "prefill"}[missed]
        timeline = dict(_replay(recording, _policy(recording)))
        tail = [
            sample
            for sample in recording["samples"]
            if _loads(sample, missed)["queue_depth"] == 0
            and _loads(sample, missed)["active_sequences"] == 0
            and min(
                (v for k, v in sample["gateway"].get("slo_attainment", {}).items() if k.startswith(missed)),
                default=1.0,
            )
            < FLOOR
        ]
        assert tail, f"{name}: the recording has no quiet sample with the {missed} attainment under {FLOOR}"
        for sample in tail:
            decisions = timeline[sample["t"]]
            assert decisions[missed].desired == 2, decisions[missed].reason
            assert "attainment" in decisions[missed].reason
            assert decisions[other].desired == 1, decisions[other].reason


# ---- each rule on plain inputs ----

PREFILL = FleetKey("m", "prefill", "r")
DECODE = FleetKey("m", "decode", "r")
COLOCATED = FleetKey("m", "colocated", "r")


def _fleet(key: FleetKey, n: int = 2, *, ttft=None, tpot=None, **load) -> FleetSignals:
    worker = WorkerSignals(
        queue_depth=load.get("queue", 0),
        prompt_tokens_pending=load.get("pending", 0),
        active_sequences=load.get("running", 0),
        kv_blocks_used=load.get("kv_used", 0),
        kv_blocks_total=100,
    )
    return FleetSignals(key, (worker,) * n, ttft_attainment=ttft, tpot_attainment=tpot)


def _decide(fleet: FleetSignals, policy: ScalingPolicy | None = None) -> Decision:
    decision, _ = decide_fleet(fleet, policy or ScalingPolicy(), None, now=0.0)
    return decision


@pytest.mark.parametrize(
    ("fleet", "desired", "reason"),
    [
        (_fleet(PREFILL, queue=12), 6, "queue 12.0 per worker > 4"),
        (_fleet(PREFILL, pending=16384), 4, "pending prompt tokens 16384 per worker"),
        (_fleet(DECODE, kv_used=96), 3, "KV utilisation 0.96 > 0.80"),
        (_fleet(DECODE, running=64), 3, "running 64.0 per worker > 57.6 (0.9 of max_running 64)"),
        (_fleet(DECODE, queue=6), 3, "queue 6.0 per worker"),
        (_fleet(COLOCATED, kv_used=90), 3, "KV utilisation 0.90"),
        (_fleet(COLOCATED, pending=12288), 3, "pending prompt tokens"),
        (_fleet(PREFILL, ttft=0.71), 3, "TTFT attainment 0.71 < 0.90"),
        (_fleet(DECODE, tpot=0.5), 3, "TPOT attainment 0.50 < 0.90"),
    ],
)
def test_each_signal_over_its_target_scales_up_in_proportion(fleet, desired, reason):
    decision = _decide(fleet)
    assert (decision.current, decision.desired) == (2, desired), decision.reason
    assert reason in decision.reason


def test_a_phase_ignores_the_other_phase_s_signals():
    assert _decide(_fleet(PREFILL, kv_used=100, running=64)).desired == 2
    assert _decide(_fleet(DECODE, pending=100_000)).desired == 2


def test_scale_up_is_limited_by_the_step_and_the_maximum():
    assert _decide(_fleet(PREFILL, queue=40)).desired == 2 + ScalingPolicy().max_step_up
    capped = _decide(_fleet(PREFILL, queue=40), ScalingPolicy(defaults=FleetLimits(max_replicas=3)))
    assert capped.desired == 3 and "capped at max 3" in capped.reason


def test_a_fleet_below_its_floor_is_brought_up_to_it_whatever_its_load():
    policy = ScalingPolicy(fleets={DECODE: FleetLimits(min_replicas=1, baseline=3)})
    decision = _decide(_fleet(DECODE, n=1), policy)
    assert decision.desired == 3 and "baseline 3" in decision.reason
    assert _decide(_fleet(PREFILL, n=0)).desired == 1


def test_signals_between_low_and_target_hold_and_restart_the_window():
    scaler = Autoscaler(ScalingPolicy(scale_down_window_s=10.0))
    assert scaler.decide([_fleet(PREFILL, n=3)], now=0.0)[0].desired == 3
    assert scaler.decide([_fleet(PREFILL, n=3, queue=3)], now=8.0)[0].reason.startswith("steady")
    assert scaler.decide([_fleet(PREFILL, n=3)], now=12.0)[0].desired == 3  # low again only since 12 s
    assert scaler.decide([_fleet(PREFILL, n=3)], now=22.0)[0].desired == 2


def test_a_step_down_keeps_enough_replicas_for_the_remaining_load():
    policy = ScalingPolicy(scale_down_window_s=0.0, max_step_down=10)
    decision = _decide(_fleet(PREFILL, n=10, queue=1), policy)  # 5 workers keep each at half the target
    assert decision.desired == math.ceil(10 * (1 / 4) / Targets().low_share)


# ---- the policy file ----


def test_the_policy_file_sets_targets_limits_and_baselines(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(
        json.dumps(
            {
                "targets": {"queue_per_worker": 2, "attainment_floor": 0.95},
                "defaults": {"max_replicas": 8},
                "scale_down_window_s": 120,
                "fleets": [{"model": "m", "role": "prefill", "region": "r", "baseline": 3, "min_replicas": 2}],
            }
        )
    )
    policy = load_policy(path)
    assert policy.targets.queue_per_worker == 2 and policy.targets.attainment_floor == 0.95
    assert policy.limits(PREFILL) == FleetLimits(min_replicas=2, max_replicas=8, baseline=3)
    assert policy.limits(DECODE) == FleetLimits(max_replicas=8)
    assert policy.scale_down_window_s == 120


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"target": {}}, "unknown key"),
        ({"targets": {"queue_per_worker": 0}}, "queue_per_worker must be above 0"),
        ({"targets": {"attainment_floor": 1.5}}, r"attainment_floor must lie in \[0, 1\]"),
        ({"defaults": {"baseline": 2}}, "unknown key"),
        ({"fleets": [{"model": "m", "role": "prefil"}]}, "needs a model and a role"),
        ({"fleets": [{"model": "m", "role": "decode", "max_replicas": 2, "baseline": 3}]}, "below"),
        ({"fleets": [{"model": "m", "role": "decode", "baseline": "2"}]}, "must be a whole number"),
        ({"max_step_up": 0}, "must be 1 or more"),
        ([], "must be a JSON object"),
    ],
)
def test_a_bad_policy_is_refused_naming_what_is_wrong(data, message):
    with pytest.raises(PolicyError, match=message):
        policy_from_json(data)


def test_an_unreadable_policy_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text("{not json")
    with pytest.raises(PolicyError, match=r"policy.json"):
        load_policy(path)


def test_a_big_step_down_stops_at_the_planner_s_baseline():
    policy = ScalingPolicy(fleets={DECODE: FleetLimits(baseline=2)}, scale_down_window_s=0.0, max_step_down=10)
    decision = _decide(_fleet(DECODE, n=6), policy)
    assert (decision.current, decision.desired) == (6, 2), decision.reason


def _plan_output(winner: str) -> dict:
    """The shape `diptych plan --json` prints (planner/report.py plan_json), trimmed to what the policy reads."""
    fleet = {"workers": 5, "cost": 5.0, "attainment": 0.97}
    return {
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9},
        "split": {**fleet, "prefill": 2, "decode": 3, "colocated": 0},
        "colocated": {**fleet, "prefill": 0, "decode": 0, "colocated": 6},
        "winner": winner,
    }


def test_the_planner_s_recommendation_becomes_the_baselines_of_the_fleets_of_its_winning_mode():
    plans = [{"model": "m", "region": "r", "plan": _plan_output("split")}]
    policy = policy_from_json(
        {"plans": plans, "fleets": [{"model": "m", "role": "decode", "region": "r", "max_replicas": 9}]}
    )
    assert policy.limits(PREFILL).baseline == 2
    assert policy.limits(DECODE) == FleetLimits(baseline=3, max_replicas=9)  # the entry's keys over the plan's
    assert policy.limits(COLOCATED).baseline == 0
    colocated = policy_from_json({"plans": [{"model": "m", "region": "r", "plan": _plan_output("colocated")}]})
    assert colocated.limits(COLOCATED).baseline == 6 and colocated.limits(PREFILL).baseline == 0
    assert _decide(_fleet(DECODE, n=1), policy).desired == 3


def test_a_plan_without_a_fleet_is_refused():
    plan = {**_plan_output("split"), "split": None, "colocated": None, "winner": None}
    with pytest.raises(PolicyError, match="the plan found no fleet"):
        policy_from_json({"plans": [{"model": "m", "region": "r", "plan": plan}]})
