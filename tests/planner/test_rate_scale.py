"""Rate scaling: when the capped trace would span fewer than HORIZON_LIFETIMES lone-request lifetimes, the
plan is made for the rate / k (k the smallest that spans the horizon within the cap) and its counts are
multiplied by k; when the trace fits, the plan is the direct one."""

import dataclasses
import json
import math
import re

import pytest

from planner import search
from planner.report import plan_json, plan_table
from planner.search import (
    HORIZON_LIFETIMES,
    MAX_TRACE_REQUESTS,
    Goal,
    evaluate,
    horizon_s,
    plan,
    rate_scale_for,
)
from planner.types import Slo
from planner.workload import PRESETS, Lengths, Workload
from tests.planner.hand_profile import HAND_PROFILE, hand_profile
from tests.planner.test_plan_cli import SLO, WORKLOAD, diptych_plan

PROFILE = hand_profile()
# a small workload whose trace spans the horizon in a few hundred requests (a lone request: 0.63 s, 189 requests)
SMALL = Workload(6.0, Lengths(256, 1024), Lengths(16, 64), requests=50)
SMALL_GOAL = Goal(Slo(ttft_s=0.6, tpot_s=0.03), attainment=0.9, max_workers=40)


def _spans_horizon(workload: Workload) -> bool:
    """Whether the trace the search simulates for `workload` spans HORIZON_LIFETIMES lone-request lifetimes."""
    requests = workload.lasting(horizon_s(PROFILE, workload, workload.rate_per_s)).requests
    return requests / workload.rate_per_s >= HORIZON_LIFETIMES * workload.lone_request_s(PROFILE) * (1 - 1e-9)


@pytest.mark.parametrize("rate", [1.0, 200.0, 230.0, 300.0, 2000.0, 12000.0])
def test_the_rate_scale_is_the_smallest_whose_trace_spans_the_horizon_within_the_cap(rate):
    workload = PRESETS["chat"].workload(rate_per_s=rate)
    scale = rate_scale_for(PROFILE, workload)
    assert _spans_horizon(workload.at_rate(rate / scale))
    if scale > 1:
        assert not _spans_horizon(workload.at_rate(rate / (scale - 1)))
        assert workload.at_rate(rate / scale).lasting(horizon_s(PROFILE, workload, rate / scale)).requests <= (
            MAX_TRACE_REQUESTS
        )


def test_fleet_scale_rates_are_scaled_and_light_ones_are_not():
    chat = PRESETS["chat"].workload
    lifetime = chat(rate_per_s=1.0).lone_request_s(PROFILE)
    assert rate_scale_for(PROFILE, chat(rate_per_s=200.0)) == 1
    assert rate_scale_for(PROFILE, chat(rate_per_s=12000.0)) == math.ceil(
        12000 * HORIZON_LIFETIMES * lifetime / MAX_TRACE_REQUESTS
    )
    assert rate_scale_for(PROFILE, chat(rate_per_s=12000.0)) > 40


def test_a_larger_request_count_asked_for_lowers_the_scale():
    workload = PRESETS["chat"].workload(rate_per_s=2000.0)
    assert rate_scale_for(PROFILE, dataclasses.replace(workload, requests=4 * MAX_TRACE_REQUESTS)) < (
        rate_scale_for(PROFILE, workload)
    )


def test_a_scaled_plan_is_the_plan_at_the_lower_rate_with_every_count_multiplied(monkeypatch):
    monkeypatch.setattr(search, "MAX_TRACE_REQUESTS", 70)  # the small workload's horizon: ~190 requests
    scale = rate_scale_for(PROFILE, SMALL)
    assert scale == 3
    scaled = plan(PROFILE, SMALL, SMALL_GOAL)
    lower = plan(PROFILE, SMALL.at_rate(SMALL.rate_per_s / scale), dataclasses.replace(SMALL_GOAL, max_workers=13))
    assert scaled.rate_scale == scale and scaled.planned_rate_per_s == pytest.approx(2.0)
    assert lower.rate_scale == 1 and lower.split is not None and lower.colocated is not None
    assert scaled.split is not None and scaled.colocated is not None
    for mine, theirs in ((scaled.split, lower.split), (scaled.colocated, lower.colocated)):
        assert (mine.fleet.prefill, mine.fleet.decode, mine.fleet.colocated) == (
            scale * theirs.fleet.prefill,
            scale * theirs.fleet.decode,
            scale * theirs.fleet.colocated,
        )
        assert mine.cost == scale * theirs.cost and mine.attainment == theirs.attainment
        assert mine.ttft_p99_s == theirs.ttft_p99_s and mine.tpot_p50_s == theirs.tpot_p50_s
    assert scaled.model_split is not None and lower.model_split is not None
    assert scaled.model_split.fleet.decode == scale * lower.model_split.fleet.decode


def test_a_scaled_fleet_past_the_largest_allowed_is_no_answer():
    # at 2 requests/s one colocated worker, and one prefill with one decode worker, meet the goal: scaled by
    # 3, 3 colocated workers fit within 5 and 6 split workers do not
    scaled = plan(PROFILE, SMALL, dataclasses.replace(SMALL_GOAL, max_workers=5), rate_scale=3)
    assert scaled.colocated is not None and scaled.colocated.fleet.colocated == 3
    assert scaled.split is None


def test_the_direct_path_is_unchanged_when_the_trace_fits():
    assert rate_scale_for(PROFILE, SMALL) == 1
    direct = plan(PROFILE, SMALL, SMALL_GOAL)
    assert direct == plan(PROFILE, SMALL, SMALL_GOAL, rate_scale=1)
    assert direct.rate_scale == 1 and direct.planned_rate_per_s is None
    assert direct.split is not None and direct.colocated is not None
    trace = SMALL.lasting(horizon_s(PROFILE, SMALL, SMALL.rate_per_s)).sample()
    for found in (direct.split, direct.colocated):  # simulated at the rate asked, on the trace that spans the horizon
        assert evaluate(PROFILE, trace, found.fleet, SMALL_GOAL.slo) == found


def test_a_rate_scale_below_one_is_refused():
    with pytest.raises(ValueError, match="rate scale is a whole number"):
        plan(PROFILE, SMALL, SMALL_GOAL, rate_scale=0)


def test_the_report_states_the_scale():
    scaled = plan(PROFILE, SMALL, SMALL_GOAL, rate_scale=2)
    assert scaled.split is not None and scaled.split.fleet.prefill % 2 == 0 and scaled.split.fleet.decode % 2 == 0
    found = plan_json(HAND_PROFILE, SMALL, SMALL_GOAL, scaled)
    assert found["rate_scale"] == 2 and found["planned_rate_per_s"] == 3.0
    assert found["split"]["workers"] == scaled.split.fleet.workers
    assert "rate scaled by 2: planned for 3 requests/s" in plan_table(PROFILE, SMALL, SMALL_GOAL, scaled)
    direct = plan_json(HAND_PROFILE, SMALL, SMALL_GOAL, plan(PROFILE, SMALL, SMALL_GOAL))
    assert direct["rate_scale"] == 1 and direct["planned_rate_per_s"] == 6.0
    assert "rate scaled" not in plan_table(PROFILE, SMALL, SMALL_GOAL, plan(PROFILE, SMALL, SMALL_GOAL))


def test_the_command_shows_the_scale_in_its_progress_and_answer(tmp_path):
    result = diptych_plan("--profile", str(HAND_PROFILE), *WORKLOAD, *SLO, "--max-workers", "20", "--rate-scale", "2")
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"^  \[ *\d+\.\d s\] rate scaling by 2: .* planning that rate and multiplying", result.stderr, re.M
    )
    assert "rate scaled by 2: planned for 3 requests/s" in result.stdout
    result = diptych_plan("--profile", str(HAND_PROFILE), *WORKLOAD, *SLO, "--max-workers", "20", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rate_scale"] == 1 and "rate scaling" not in result.stderr


def test_a_bad_rate_scale_is_refused_by_the_command():
    result = diptych_plan("--profile", str(HAND_PROFILE), *WORKLOAD, *SLO, "--rate-scale", "0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("diptych plan: --rate-scale is a whole number of 1 or more, not 0")
