"""The search: the fleets it returns meet the goal and no fleet one worker smaller does; goodput is the
highest rate meeting the target; and the direction of the disaggregation result: split serving has more
goodput per worker on a prefill-heavy, tight-TTFT mix and not on a decode-heavy, loose-TTFT one."""

from pathlib import Path

import pytest

from planner.profile import load_profile
from planner.search import (
    PRECISION,
    Goal,
    _Candidates,
    _smallest,
    _tolerance,
    compare_goodput,
    evaluate,
    goodput,
    horizon_s,
    plan,
)
from planner.types import FleetShape, Mode, Slo
from planner.workload import PRESETS, Lengths, Workload
from tests.planner.hand_profile import hand_profile

PROFILE = hand_profile()
MEASURED = Path(__file__).resolve().parents[2] / "planner" / "profiles" / "cpu-diptych-100m.json"


def test_split_has_more_goodput_per_worker_on_a_prefill_heavy_tight_ttft_mix():
    preset = PRESETS["summarize"]
    found = compare_goodput(PROFILE, preset.workload(requests=400), preset.slo(PROFILE))
    print(
        f"summarize: split {found.split.fleet} {found.split.per_worker:.2f}, colocated {found.colocated.per_worker:.2f}"
    )
    assert found.split_wins
    assert found.split.per_worker > 1.5 * found.colocated.per_worker
    assert found.split.fleet.prefill > found.split.fleet.decode  # prefill is where the work is


def test_colocated_has_at_least_the_goodput_per_worker_of_split_on_a_decode_heavy_loose_ttft_mix():
    preset = PRESETS["chat"]
    found = compare_goodput(PROFILE, preset.workload(requests=400), preset.slo(PROFILE))
    print(f"chat: split {found.split.fleet} {found.split.per_worker:.2f}, colocated {found.colocated.per_worker:.2f}")
    assert not found.split_wins
    assert found.colocated.per_worker >= 1.05 * found.split.per_worker


@pytest.mark.skipif(not MEASURED.is_file(), reason=f"no measured profile at {MEASURED} (bench.phase_costs writes it)")
def test_the_measured_cpu_profile_reproduces_the_direction_on_both_mixes():
    profile = load_profile(MEASURED)
    found = {}
    for name in ("summarize", "chat"):
        preset = PRESETS[name]
        found[name] = compare_goodput(profile, preset.workload(requests=400), preset.slo(profile))
        print(f"{name}: split {found[name].split.per_worker:.2f}, colocated {found[name].colocated.per_worker:.2f}")
    assert found["summarize"].split_wins
    assert not found["chat"].split_wins


def test_the_cheapest_fleets_meet_the_goal_and_one_worker_fewer_does_not():
    workload = Workload(12.0, Lengths(256, 1536), Lengths(32, 160), requests=600)
    slo = Slo(ttft_s=0.6, tpot_s=0.03)
    goal = Goal(slo, attainment=0.9, max_workers=40)
    result = plan(PROFILE, workload, goal)
    assert result.split is not None and result.colocated is not None
    requests = workload.lasting(horizon_s(PROFILE, workload, workload.rate_per_s)).sample()

    def attainment(fleet: FleetShape) -> float:
        return evaluate(PROFILE, requests, fleet, slo).attainment

    split, colocated = result.split.fleet, result.colocated.fleet
    assert attainment(split) >= 0.9 and attainment(colocated) >= 0.9
    assert attainment(FleetShape(Mode.COLOCATED, colocated=colocated.colocated - 1)) < 0.9
    for smaller in (
        FleetShape(Mode.SPLIT, prefill=split.prefill - 1, decode=split.decode),
        FleetShape(Mode.SPLIT, prefill=split.prefill, decode=split.decode - 1),
    ):
        if smaller.prefill and smaller.decode:
            assert attainment(smaller) < 0.9, smaller


def test_the_split_search_walks_down_from_a_poor_ratio_to_a_fleet_no_worker_smaller(monkeypatch):
    monkeypatch.setattr("planner.search.PREFILL_SHARES", (1 / 2,))  # prefill-heavy work, half the fleet decodes
    workload = Workload(8.0, Lengths(1024, 2048), Lengths(8, 32), requests=400)
    slo = Slo(ttft_s=0.8, tpot_s=0.03)
    result = plan(PROFILE, workload, Goal(slo, max_workers=40), search="full")
    assert result.split is not None
    split = result.split.fleet
    assert split.decode < split.prefill
    requests = workload.lasting(horizon_s(PROFILE, workload, workload.rate_per_s)).sample()
    for smaller in ((split.prefill - 1, split.decode), (split.prefill, split.decode - 1)):
        if min(smaller) >= 1:
            fleet = FleetShape(Mode.SPLIT, prefill=smaller[0], decode=smaller[1])
            assert evaluate(PROFILE, requests, fleet, slo).attainment < 0.9, fleet


def test_attainment_grows_with_the_fleet():
    requests = Workload(10.0, Lengths(256, 1536), Lengths(32, 160), requests=600).sample()
    slo = Slo(ttft_s=0.6, tpot_s=0.03)
    shares = [evaluate(PROFILE, requests, FleetShape(Mode.COLOCATED, colocated=n), slo).attainment for n in range(1, 7)]
    assert shares == sorted(shares) and shares[0] < 0.5 < shares[-1]


@pytest.mark.parametrize("high", [1, 2, 3, 7, 8, 50])
def test_smallest_finds_the_first_count_that_meets_from_any_hint(high):
    for hint in (None, *range(1, high + 1)):
        for first in range(1, high + 1):
            assert _smallest(lambda n, first=first: n >= first, 1, high, hint) == first
        assert _smallest(lambda n: False, 1, high, hint) is None


@pytest.mark.parametrize("first", [1, 7, 49, 50, 51, 333, 999, 1000])
def test_smallest_within_a_precision_meets_and_a_tolerance_below_it_does_not(first):
    for hint in (None, 1, first // 2, first, first + 3, int(first * 1.3), 1000):
        asked: list[int] = []

        def meets(n: int, asked: list[int] = asked) -> bool:
            asked.append(n)
            return n >= first

        found = _smallest(meets, 1, 1000, hint, PRECISION)
        assert found is not None and found >= first
        assert found - _tolerance(found, PRECISION) < first  # the count a tolerance below fails
        assert len(asked) <= 24


def test_the_narrow_search_answers_as_the_full_one_with_fewer_simulations():
    preset = PRESETS["chat"]
    workload, goal = preset.workload(requests=400, rate_per_s=60.0), Goal(preset.slo(PROFILE), max_workers=100)
    narrow, full = plan(PROFILE, workload, goal), plan(PROFILE, workload, goal, search="full")
    assert narrow.split is not None and full.split is not None
    assert narrow.colocated is not None and full.colocated is not None
    print(f"narrow: {narrow.split.fleet} {narrow.colocated.fleet} ({narrow.simulations} simulated)")
    print(f"full: {full.split.fleet} {full.colocated.fleet} ({full.simulations} simulated)")
    assert narrow.colocated.fleet == full.colocated.fleet
    assert narrow.split.cost <= full.split.cost + 1
    assert narrow.simulations * 2 < full.simulations


def test_no_fleet_meets_an_slo_tighter_than_a_request_alone():
    workload = Workload(2.0, Lengths(1024, 1024), Lengths(8, 8), requests=100)
    result = plan(PROFILE, workload, Goal(Slo(ttft_s=0.05, tpot_s=0.05), max_workers=8))
    assert result.split is None and result.colocated is None
    found = goodput(PROFILE, workload, FleetShape(Mode.COLOCATED, colocated=1), Slo(0.05, 0.05), 0.9)
    assert found.rate_per_s == 0.0


def test_goodput_is_the_highest_rate_that_meets_the_target():
    preset = PRESETS["code"]
    workload, slo, fleet = preset.workload(requests=300), preset.slo(PROFILE), FleetShape(Mode.COLOCATED, colocated=2)
    found = goodput(PROFILE, workload, fleet, slo, 0.9)

    def attainment(rate: float) -> float:
        requests = workload.at_rate(rate).lasting(horizon_s(PROFILE, workload, rate)).sample()
        return evaluate(PROFILE, requests, fleet, slo).attainment

    assert found.rate_per_s > 0
    assert attainment(found.rate_per_s) >= 0.9
    assert attainment(found.rate_per_s * 1.05) < 0.9


def test_the_search_simulates_each_fleet_once():
    candidates = _Candidates(
        PROFILE, Workload(2.0, Lengths(64, 64), Lengths(4, 4), requests=20).sample(), Goal(Slo(1.0, 1.0)), None
    )
    fleet = FleetShape(Mode.COLOCATED, colocated=1)
    assert candidates.evaluate(fleet) is candidates.evaluate(fleet)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attainment": 0.0}, r"attainment target is a share in \(0, 1\]"),
        ({"attainment": 1.5}, r"attainment target is a share in \(0, 1\]"),
        ({"max_workers": 1001}, "2 to 1000 workers"),
        ({"max_workers": 1}, "2 to 1000 workers"),
        ({"slo": Slo(0.0, 0.1)}, "must be positive"),
    ],
)
def test_a_goal_out_of_range_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        Goal(**{"slo": Slo(1.0, 0.1), **change})
