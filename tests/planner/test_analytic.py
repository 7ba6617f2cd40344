"""The queueing model: a lone request priced as the simulator prices it, predictions that grow with the fleet,
fleets that cannot keep up predicted to fail, Erlang C on known figures, and the model's fleet close to the
one the simulation finds."""

import numpy as np
import pytest

from planner.analytic import FleetModel, _erlang_c
from planner.search import Goal, evaluate, horizon_s, plan
from planner.types import FleetShape, Mode, RequestSpec, Slo
from planner.workload import PRESETS, Lengths, Workload, prefill_alone_s
from tests.planner.hand_profile import hand_profile

PROFILE = hand_profile()
LOOSE = Slo(ttft_s=10.0, tpot_s=1.0)


def chat_trace(rate: float) -> list[RequestSpec]:
    workload = PRESETS["chat"].workload(requests=400, rate_per_s=rate)
    return workload.lasting(horizon_s(PROFILE, workload, rate)).sample()


def test_erlang_c_matches_the_textbook_figures():
    assert _erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: the chance to wait is the utilization
    assert _erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert _erlang_c(10, 8.0) == pytest.approx(0.4092, abs=1e-4)


def test_a_trickle_on_a_large_fleet_costs_a_lone_request():
    requests = [RequestSpec(i * 100.0, 300, 20) for i in range(1, 40)]
    model = FleetModel(PROFILE, requests, LOOSE)
    ttft = model.split_ttft(50)
    lone = prefill_alone_s(PROFILE, 300) + PROFILE.ttft_overhead_for(Mode.SPLIT)
    assert ttft.max() == pytest.approx(lone, rel=0.02)
    found = model.predict(FleetShape(Mode.COLOCATED, colocated=50))
    assert found.tpot_p50_s == pytest.approx(
        PROFILE.decode_step_s(1, model.context) + PROFILE.per_token_overhead_s, rel=0.05
    )


@pytest.mark.parametrize("mode", [Mode.COLOCATED, Mode.SPLIT])
def test_predicted_attainment_grows_with_the_fleet(mode):
    model = FleetModel(PROFILE, chat_trace(200.0), PRESETS["chat"].slo(PROFILE))

    def fleet(n: int) -> FleetShape:
        if mode is Mode.COLOCATED:
            return FleetShape(mode, colocated=n)
        return FleetShape(mode, prefill=max(1, n // 10), decode=n - max(1, n // 10))

    shares = [model.predict(fleet(n)).attainment for n in range(2, 60, 2)]
    assert shares == sorted(shares)
    assert shares[0] < 0.5 and shares[-1] > 0.9


def test_a_fleet_that_cannot_keep_up_is_predicted_to_fail_every_request():
    model = FleetModel(PROFILE, chat_trace(400.0), LOOSE)
    # one prefill worker computing 400 prompts a second of 40 tokens: far past its throughput
    assert np.isinf(model.split_ttft(1)).all()
    assert model.predict(FleetShape(Mode.SPLIT, prefill=1, decode=100)).attainment == 0.0


def test_no_fleet_meets_an_slo_tighter_than_a_request_alone():
    requests = Workload(2.0, Lengths(1024, 1024), Lengths(8, 8), requests=100).sample()
    model = FleetModel(PROFILE, requests, Slo(ttft_s=0.05, tpot_s=0.05))
    assert model.smallest_colocated(0.9) is None and model.smallest_split(0.9) is None


@pytest.mark.parametrize("rate", [60.0, 300.0])
def test_the_models_fleets_are_within_a_tenth_of_the_simulations(rate):
    preset = PRESETS["chat"]
    workload, slo = preset.workload(requests=400, rate_per_s=rate), preset.slo(PROFILE)
    result = plan(PROFILE, workload, Goal(slo, max_workers=200))
    assert result.colocated is not None and result.split is not None
    assert result.model_colocated is not None and result.model_split is not None
    for model, simulated in ((result.model_colocated, result.colocated), (result.model_split, result.split)):
        print(f"rate {rate}: model {model.fleet}, simulation {simulated.fleet}")
        assert abs(model.fleet.workers - simulated.fleet.workers) <= max(2, 0.1 * simulated.fleet.workers)
    requests = workload.lasting(horizon_s(PROFILE, workload, rate)).sample()
    # the model's own colocated fleet, simulated: its prediction of the attainment is close
    found = evaluate(PROFILE, requests, result.model_colocated.fleet, slo)
    assert found.attainment == pytest.approx(result.model_colocated.attainment, abs=0.1)
