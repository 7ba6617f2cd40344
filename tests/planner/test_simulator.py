"""The fleet simulator: exact times for cases worked out by hand from the profile's formulas, conservation
of requests and tokens, KV memory limiting decode admission, colocated prefill lengthening decode steps,
and a 1,000-worker fleet."""

import math
import time

import pytest

from planner.simulator import RoutingOptions, _Pricer, simulate, simulate_with_totals
from planner.types import FleetShape, Mode, RequestSpec
from planner.workload import Lengths, Workload
from tests.planner.hand_profile import hand_profile

PROFILE = hand_profile()
SPLIT_1_1 = FleetShape(Mode.SPLIT, prefill=1, decode=1)
COLOCATED_1 = FleetShape(Mode.COLOCATED, colocated=1)


def prefill_s(*chunks: tuple[int, int]) -> float:
    """One step computing these prompt chunks, (tokens, position in the prompt) each."""
    return PROFILE.step_s(sum(tokens for tokens, _ in chunks), 0, 0.0, chunks)


def decode_steps_s(first_context: int, steps: int, batch: int = 1) -> float:
    return sum(PROFILE.decode_step_s(batch, first_context + i) for i in range(steps))


def test_one_request_on_a_colocated_worker_takes_its_prefill_then_one_decode_step_per_token():
    (outcome,) = simulate(PROFILE, [RequestSpec(0.5, 100, 5)], COLOCATED_1)
    # the prompt's step emits token 1; tokens 2..5 each take a step whose context holds the token before
    assert outcome.ttft_s == pytest.approx(prefill_s((100, 0)) + PROFILE.ttft_overhead_s)
    assert outcome.tpot_s == pytest.approx(decode_steps_s(101, 4) / 4 + PROFILE.per_token_overhead_s)


def test_one_split_request_waits_for_its_kv_transfer_before_decoding():
    (outcome,) = simulate(PROFILE, [RequestSpec(0.0, 100, 5, cached_prompt_tokens=32)], SPLIT_1_1)
    assert outcome.ttft_s == pytest.approx(prefill_s((68, 32)) + PROFILE.ttft_overhead_s)
    # only the uncached tokens' KV moves; the decode worker's first step computes token 1, samples token 2
    decode_s = PROFILE.kv_transfer_s(68) + decode_steps_s(101, 4)
    assert outcome.tpot_s == pytest.approx(decode_s / 4 + PROFILE.per_token_overhead_s)


def test_a_prompt_longer_than_the_token_budget_is_computed_in_chunks():
    (outcome,) = simulate(PROFILE, [RequestSpec(0.0, 1200, 1)], SPLIT_1_1)
    chunks = prefill_s((512, 0)) + prefill_s((512, 512)) + prefill_s((176, 1024))
    assert abs(chunks - prefill_s((1200, 0))) > 0.001  # each step's fixed cost: a difference the test sees
    assert outcome.ttft_s == pytest.approx(chunks + PROFILE.ttft_overhead_s)
    assert outcome.tpot_s == 0.0


def test_requests_arriving_together_go_to_different_workers():
    requests = [RequestSpec(0.0, 300, 1), RequestSpec(0.0, 300, 1)]
    outcomes = simulate(PROFILE, requests, FleetShape(Mode.COLOCATED, colocated=2))
    alone = prefill_s((300, 0)) + PROFILE.ttft_overhead_s
    assert [o.ttft_s for o in outcomes] == pytest.approx([alone, alone])


def test_prompts_waiting_together_share_the_token_budget_of_one_worker():
    requests = [RequestSpec(0.0, 300, 1), RequestSpec(0.001, 300, 1), RequestSpec(0.001, 300, 1)]
    first, second, third = simulate(PROFILE, requests, COLOCATED_1)
    # the first prompt's step is under way when the others come: the next step computes the second prompt
    # and 212 tokens of the third, the step after it the third's last 88
    steps = [prefill_s((300, 0)), prefill_s((300, 0), (212, 0)), prefill_s((88, 212))]
    overhead = PROFILE.ttft_overhead_s
    assert first.ttft_s == pytest.approx(steps[0] + overhead)
    assert second.ttft_s == pytest.approx(steps[0] + steps[1] - 0.001 + overhead)
    assert third.ttft_s == pytest.approx(sum(steps) - 0.001 + overhead)


def test_a_request_arriving_while_a_worker_decodes_joins_its_next_step():
    decoding, arriving = RequestSpec(0.0, 16, 50), RequestSpec(0.1, 16, 1)
    first, second = simulate(PROFILE, [decoding, arriving], COLOCATED_1)
    ends, now = [], prefill_s((16, 0))
    for context in range(17, 17 + 49):
        now += PROFILE.decode_step_s(1, context)
        ends.append((now, context))
    under_way_end, context = next((end, context) for end, context in ends if end > 0.1)
    mixed = PROFILE.step_s(16, 1, context + 1, [(16, 0)])
    assert second.ttft_s == pytest.approx(under_way_end + mixed - 0.1 + PROFILE.ttft_overhead_s)
    assert first.tpot_s > decode_steps_s(17, 49) / 49 + PROFILE.per_token_overhead_s  # it shared a step


@pytest.mark.parametrize(
    "fleet",
    [FleetShape(Mode.SPLIT, prefill=2, decode=3), FleetShape(Mode.COLOCATED, colocated=4)],
    ids=["split", "colocated"],
)
def test_every_request_finishes_once_and_every_token_is_accounted_for(fleet):
    workload = Workload(6.0, Lengths(16, 1500), Lengths(1, 300), requests=800, prefix_share=0.5, prefix_tokens=64)
    requests = workload.sample()
    outcomes, totals = simulate_with_totals(PROFILE, requests, fleet)
    assert [o.spec for o in outcomes] == requests
    assert totals.output_tokens == sum(r.output_tokens for r in requests)
    assert totals.prompt_tokens_computed == sum(max(1, r.prompt_tokens - r.cached_prompt_tokens) for r in requests)
    for outcome in outcomes:
        uncached = outcome.spec.prompt_tokens - outcome.spec.cached_prompt_tokens
        assert math.isfinite(outcome.ttft_s) and math.isfinite(outcome.tpot_s)
        assert outcome.ttft_s >= PROFILE.ttft_overhead_s + PROFILE.prefill_step_s(min(uncached, 512)) - 1e-9
        if outcome.spec.output_tokens > 1:
            assert outcome.tpot_s >= PROFILE.per_token_overhead_s + PROFILE.decode_step_s(1, 0) - 1e-9
        else:
            assert outcome.tpot_s == 0.0


def test_the_same_trace_gives_the_same_outcomes():
    requests = Workload(8.0, Lengths(64, 900), Lengths(8, 200), requests=300, seed=3).sample()
    fleet = FleetShape(Mode.SPLIT, prefill=1, decode=2)
    assert simulate(PROFILE, requests, fleet) == simulate(PROFILE, requests, fleet)


def test_decode_admission_waits_for_kv_memory():
    # each sequence needs 512 tokens of KV (32 blocks): 1,024 tokens hold two at a time
    requests = [RequestSpec(0.0, 256, 256) for _ in range(4)]
    roomy = simulate(PROFILE, requests, SPLIT_1_1)
    tight = simulate(hand_profile(kv_capacity_tokens=1024), requests, SPLIT_1_1)
    assert max(o.tpot_s for o in roomy) < 1.2 * min(o.tpot_s for o in roomy)
    held_back = sorted(o.tpot_s for o in tight)
    # two decode while two wait a whole decode lifetime for their blocks
    assert held_back[2] > 1.8 * held_back[1]
    assert held_back[0] < max(o.tpot_s for o in roomy)


def test_prompts_on_a_colocated_worker_lengthen_the_decode_steps_of_its_sequences():
    decoding = RequestSpec(0.0, 64, 400)
    prompts = [RequestSpec(0.5 + 0.25 * i, 2048, 1) for i in range(8)]
    colocated = simulate(PROFILE, [decoding, *prompts], FleetShape(Mode.COLOCATED, colocated=1))
    split = simulate(PROFILE, [decoding, *prompts], SPLIT_1_1)
    (alone,) = simulate(PROFILE, [decoding], FleetShape(Mode.COLOCATED, colocated=1))
    assert split[0].tpot_s < 1.1 * alone.tpot_s
    assert colocated[0].tpot_s > 1.5 * split[0].tpot_s


def test_the_routing_options_run_short_prompts_whole_on_the_decode_worker():
    requests = [RequestSpec(0.0, 20, 3)]
    (skipped,) = simulate(PROFILE, requests, SPLIT_1_1, RoutingOptions(skip_split_below=32))
    (split,) = simulate(PROFILE, requests, SPLIT_1_1)
    assert skipped.tpot_s == pytest.approx(decode_steps_s(21, 2) / 2 + PROFILE.per_token_overhead_s)
    assert split.tpot_s > skipped.tpot_s  # the KV transfer


def test_the_fast_pricer_prices_every_step_as_the_profile_does():
    pricer = _Pricer(PROFILE)
    for chunks in ([], [(1, 0)], [(17, 300)], [(512, 0)], [(200, 1000), (312, 0)]):
        tokens = sum(count for count, _ in chunks)
        for batch in (0, 1, 7, 64):
            for context in (0.0, 100.5, 128.0, 700.25, 2048.0, 4000.0):
                expected = PROFILE.step_s(tokens, batch, context, chunks)
                assert pricer.step_s(chunks, batch, context) == pytest.approx(expected, abs=1e-12)


def test_a_fleet_of_a_thousand_workers_serves_twenty_thousand_requests_in_seconds():
    requests = Workload(400.0, Lengths(64, 2048), Lengths(16, 256), requests=20_000).sample()
    started = time.monotonic()
    outcomes, totals = simulate_with_totals(PROFILE, requests, FleetShape(Mode.SPLIT, prefill=400, decode=600))
    elapsed = time.monotonic() - started
    print(f"1,000 workers: {len(requests) / elapsed:.0f} requests simulated per second ({totals.steps} steps)")
    assert len(outcomes) == 20_000 and elapsed < 120
    assert totals.output_tokens == sum(r.output_tokens for r in requests)


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        (FleetShape(Mode.SPLIT, prefill=1), "at least one prefill and one decode"),
        (FleetShape(Mode.COLOCATED, colocated=0), "at least one colocated"),
        (FleetShape(Mode.COLOCATED, colocated=1, decode=1), "no prefill or decode"),
    ],
)
def test_a_fleet_without_the_workers_its_mode_needs_is_refused(fleet, message):
    with pytest.raises(ValueError, match=message):
        simulate(PROFILE, [RequestSpec(0.0, 10, 2)], fleet)


def test_a_request_larger_than_a_workers_kv_memory_is_refused():
    with pytest.raises(ValueError, match="request 0 needs 2000 tokens of KV"):
        simulate(hand_profile(kv_capacity_tokens=1024), [RequestSpec(0.0, 1500, 500)], SPLIT_1_1)
