"""The two benchmark profiles: `quick` on the tiny model (minutes) and `full` on the 100 M model."""

from dataclasses import dataclass

from bench.stats import Slo
from bench.workload import WorkloadSpec


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    context_length: int
    workload: WorkloadSpec  # the Poisson runs and the closed-loop run draw from it
    rates_per_s: tuple[float, ...]
    poisson_requests: int
    closed_loop_requests: int
    closed_loop_repeats: int  # each mode's closed loop runs this often; the median run stands
    concurrency: int
    baseline_max_batch: int  # the largest static batch `generate` takes in the Poisson runs
    slo: Slo
    prefix_prompt_tokens: int
    prefix_shared_fraction: float
    prefix_samples: int
    greedy_samples: int
    greedy_max_tokens: int


QUICK = Profile(
    name="quick",
    model="diptych-tiny",
    context_length=1024,
    workload=WorkloadSpec(
        requests=64,
        prompt_tokens_mean=128,
        prompt_tokens_min=16,
        prompt_tokens_max=512,
        output_tokens_min=16,
        output_tokens_max=64,
        shared_prefix_share=0.5,
        shared_prefix_tokens=64,
        vocab_size=512,
    ),
    rates_per_s=(2.0, 5.0, 10.0, 20.0),
    poisson_requests=48,
    closed_loop_requests=96,
    closed_loop_repeats=3,
    concurrency=32,
    baseline_max_batch=32,
    slo=Slo(ttft_s=0.5, tpot_s=0.05),
    prefix_prompt_tokens=768,
    prefix_shared_fraction=0.9,
    prefix_samples=8,
    greedy_samples=8,
    greedy_max_tokens=32,
)

FULL = Profile(
    name="full",
    model="diptych-100m",
    context_length=2048,
    workload=WorkloadSpec(
        requests=64,
        prompt_tokens_mean=128,
        prompt_tokens_min=32,
        prompt_tokens_max=384,
        output_tokens_min=16,
        output_tokens_max=48,
        shared_prefix_share=0.5,
        shared_prefix_tokens=64,
        vocab_size=32000,
    ),
    rates_per_s=(0.5, 1.0, 2.0),
    poisson_requests=20,
    closed_loop_requests=64,
    closed_loop_repeats=3,
    concurrency=32,
    baseline_max_batch=32,
    slo=Slo(ttft_s=3.0, tpot_s=0.3),
    prefix_prompt_tokens=1024,
    prefix_shared_fraction=0.9,
    prefix_samples=4,
    greedy_samples=4,
    greedy_max_tokens=24,
)

PROFILES = {p.name: p for p in (QUICK, FULL)}
