"""`python -m bench.phase_costs`: the cost profile it measures on the tiny model with a few points (a real
model runner, a real KV transfer to another process, a short live run through a real gateway), and the
arithmetic that turns measurements into the profile's fields."""

import json
import subprocess
import sys

import pytest

from bench.phase_costs import LiveSample, PointSets, _fit_line, _prompt_alone_s, handoff_extra_s, overheads
from diptych_server.stack import REPO_ROOT
from planner.profile import CostProfile, load_profile
from planner.types import Mode

RUN_TIMEOUT_S = 300


def _profile(**fields) -> CostProfile:
    values = dict(
        model="m",
        hardware="h",
        measured_with="",
        block_size=16,
        token_budget=512,
        max_running=64,
        kv_capacity_tokens=4096,
        prefill_points=((16, 0.016), (512, 0.512)),  # 1 ms a token
        decode_points=((1, 128, 0.010), (1, 1024, 0.010), (8, 128, 0.020), (8, 1024, 0.020)),
        kv_fixed_s=0.001,
        kv_per_token_s=1e-6,
        ttft_overhead_s=0.0,
        per_token_overhead_s=0.0,
    )
    values.update(fields)
    return CostProfile(**values)


def test_a_tiny_profile_is_measured_well_formed_and_round_trips(tmp_path):
    out = tmp_path / "tiny.json"
    command = [
        sys.executable,
        "-m",
        "bench.phase_costs",
        "--model",
        "diptych-tiny",
        "--out",
        str(out),
        "--repeats",
        "3",
        "--prefill-tokens",
        "16,512",
        "--decode-batches",
        "1,64",
        "--decode-contexts",
        "128,512",
        "--kv-tokens",
        "16,512",
        "--live-prompts",
        "48,128",
        "--live-rounds",
        "1",
        "--live-output-tokens",
        "6",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    profile = load_profile(out)
    assert profile.model == "diptych-tiny" and "bench.phase_costs" in profile.measured_with
    assert (profile.block_size, profile.token_budget, profile.max_running) == (16, 512, 64)
    assert profile.kv_capacity_tokens == 65536  # 256 MiB of 4 layers x 2 x 2 heads x 64 float32 per token
    assert [tokens for tokens, _ in profile.prefill_points] == [16, 512]
    assert profile.prefill_step_s(512) > profile.prefill_step_s(16) > 0
    assert sorted((b, c) for b, c, _ in profile.decode_points) == [(1, 128), (1, 512), (64, 128), (64, 512)]
    for context in (128, 512):
        assert profile.decode_step_s(64, context) > profile.decode_step_s(1, context) > 0
    assert profile.kv_transfer_s(512) >= profile.kv_transfer_s(16) > 0
    assert profile.ttft_overhead_s >= 0 and profile.per_token_overhead_s >= 0 and profile.attention_pair_s >= 0
    assert profile.split_ttft_overhead_s is not None and profile.split_ttft_overhead_s >= 0
    assert CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert "decode step (ms)" in result.stdout and "overhead outside the engine" in result.stdout
    assert result.stdout.count("sequences at context") == 4  # the mixed steps, each against its price
    live = [line.split() for line in result.stdout.splitlines() if line.startswith(("  colocated ", "  split"))]
    assert [row[:3] for row in live] == [
        [mode, prompt, "6"] for mode in ("colocated", "split", "split+busy") for prompt in ("48", "128")
    ]


def test_a_profile_without_prefill_attention_still_loads_and_prices_tokens_by_count():
    data = _profile().to_json()
    del data["prefill_attention"]
    profile = CostProfile.from_json(data)
    assert profile.attention_pair_s == 0.0
    assert profile.step_s(512, 0, 0.0, [(256, 256), (256, 0)]) == pytest.approx(0.512)


def test_a_split_ttft_overhead_applies_to_split_fleets_and_a_profile_without_one_uses_the_common_one():
    common = _profile(ttft_overhead_s=0.004)
    assert "split_ttft_seconds" not in common.to_json()["overhead"]
    assert CostProfile.from_json(common.to_json()).split_ttft_overhead_s is None
    assert common.ttft_overhead_for(Mode.SPLIT) == common.ttft_overhead_for(Mode.COLOCATED) == 0.004
    split = _profile(ttft_overhead_s=0.004, split_ttft_overhead_s=0.02)
    assert CostProfile.from_json(json.loads(json.dumps(split.to_json()))) == split
    assert (split.ttft_overhead_for(Mode.SPLIT), split.ttft_overhead_for(Mode.COLOCATED)) == (0.02, 0.004)
    assert _profile(split_ttft_overhead_s=0.0).ttft_overhead_for(Mode.SPLIT) == 0.0  # measured as none


def test_prefill_attention_prices_a_later_chunk_above_a_first_one_and_packed_prompts_below_one_long():
    profile = _profile(attention_pair_s=1e-6)
    alone = profile.prefill_step_s(256)
    assert profile.step_s(256, 0, 0.0, [(256, 0)]) == pytest.approx(alone)
    assert profile.step_s(256, 0, 0.0, [(256, 1024)]) == pytest.approx(alone + 1e-6 * 256 * 1024)
    # four prompts of 128 attend over 4 x 128 x 64 pairs, one of 512 over 512 x 256
    packed = profile.step_s(512, 0, 0.0, [(128, 0)] * 4)
    assert packed == pytest.approx(0.512 - 1e-6 * (512 * 256 - 4 * 128 * 64))
    assert CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def test_overheads_are_what_live_requests_took_beyond_their_engine_steps():
    profile = _profile()
    samples = [
        LiveSample("split", 128, 9, ttft_s=0.128 + 0.004, tpot_s=0.010 + 0.0005, second_token_s=0.001 + 0.0128 + 0.010),
        LiveSample("split", 256, 5, ttft_s=0.256 + 0.012, tpot_s=0.010 + 0.0019, second_token_s=0.001 + 0.0256 + 0.013),
        LiveSample("split", 64, 5, ttft_s=0.064 + 0.005, tpot_s=0.010 + 0.0006, second_token_s=0.001 + 0.0064 + 0.011),
    ]
    ttft, per_token = overheads(profile, samples)
    assert ttft == pytest.approx(0.005) and per_token == pytest.approx(0.0006)
    assert overheads(profile, [LiveSample("colocated", 128, 5, 0.100, 0.009, 0.009)]) == (0.0, 0.0)  # faster
    # the second token: a KV transfer of 1 ms + 0.1 ms per token, a 10 ms decode step, and what is left
    assert handoff_extra_s(_profile(kv_per_token_s=1e-4), samples) == pytest.approx(0.001)


def test_a_prompt_longer_than_the_budget_is_priced_in_chunks_at_their_positions():
    profile = _profile(attention_pair_s=1e-6)
    expected = 2 * profile.prefill_step_s(512) + profile.prefill_step_s(100) + 1e-6 * (512 * 512 + 100 * 1024)
    assert _prompt_alone_s(profile, 1124) == pytest.approx(expected)


def test_the_kv_fit_recovers_a_line_and_never_goes_negative():
    assert _fit_line([16, 128, 512], [0.002 + 1e-5 * t for t in (16, 128, 512)]) == pytest.approx((0.002, 1e-5))
    intercept, slope = _fit_line([16, 512], [0.003, 0.001])  # noise: a falling line
    assert slope == 0.0 and intercept == pytest.approx(0.002)
    assert _fit_line([64], [0.004]) == (0.004, 0.0)


def test_points_past_the_models_context_are_cut_to_it_or_left_out():
    points = PointSets(prefill_tokens=(16, 512, 1024, 2048), decode_contexts=(128, 1024, 2048)).within(1024)
    assert points.prefill_tokens == (16, 512, 1023)  # a step samples a token after its prompt
    assert points.decode_contexts == (128, 1022)
    assert max(points.kv_tokens) == 1023
    assert points.attention_chunks and all(tokens + start <= 1023 for tokens, start in points.attention_chunks)
    assert points.live_prompts and all(tokens + points.live_output_tokens <= 1023 for tokens in points.live_prompts)
