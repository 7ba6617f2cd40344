"""Synthetic workloads: prompt and output lengths, Poisson arrival times and a shared-prefix share.

Prompts are token ids drawn from the model's vocabulary (past its special tokens), so their lengths are
exact and the same workload replays identically against every serving mode. Everything follows from
the seed.
"""

import random
from dataclasses import dataclass

FIRST_ORDINARY_TOKEN = 6  # the built-in tokenizers put <s>, </s>, <pad> and three role tokens first


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int
    prompt_tokens_mean: int
    prompt_tokens_min: int
    prompt_tokens_max: int
    output_tokens_min: int
    output_tokens_max: int
    shared_prefix_share: float  # fraction of requests that open with the shared prefix
    shared_prefix_tokens: int
    vocab_size: int
    seed: int = 0


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    output_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run; 0 for closed-loop runs
    shares_prefix: bool = False


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(count)]


def prompt_length(rng: random.Random, spec: WorkloadSpec) -> int:
    """Exponential around the mean, clipped: many short prompts and a tail of long ones."""
    length = round(rng.expovariate(1.0 / spec.prompt_tokens_mean))
    return max(spec.prompt_tokens_min, min(spec.prompt_tokens_max, length))


def make_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    shared_prefix = random_tokens(rng, spec.shared_prefix_tokens, spec.vocab_size)
    requests = []
    for index in range(spec.requests):
        length = prompt_length(rng, spec)
        shares = rng.random() < spec.shared_prefix_share and length > spec.shared_prefix_tokens
        head = shared_prefix if shares else []
        prompt = head + random_tokens(rng, length - len(head), spec.vocab_size)
        output = rng.randint(spec.output_tokens_min, spec.output_tokens_max)
        requests.append(BenchRequest(index, prompt, output, shares_prefix=shares))
    return requests


def poisson_arrivals(count: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of a Poisson process at `rate_per_s`, the first at 0."""
    if rate_per_s <= 0:
        raise ValueError(f"the arrival rate must be positive, got {rate_per_s}")
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for _ in range(count):
        arrivals.append(now)
        now += rng.expovariate(rate_per_s)
    return arrivals


def with_arrivals(requests: list[BenchRequest], rate_per_s: float, seed: int) -> list[BenchRequest]:
    arrivals = poisson_arrivals(len(requests), rate_per_s, seed)
    return [
        BenchRequest(r.index, r.prompt_token_ids, r.output_tokens, arrival, r.shares_prefix)
        for r, arrival in zip(requests, arrivals, strict=True)
    ]


def shared_prefix_prompts(
    length: int, shared_fraction: float, count: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """`count` cold prompts (nothing in common) and `count` + 1 prompts that share their first
    `shared_fraction` of tokens (the first of them warms the cache)."""
    rng = random.Random(seed)
    cold = [random_tokens(rng, length, vocab_size) for _ in range(count)]
    prefix = random_tokens(rng, round(length * shared_fraction), vocab_size)
    warm = [prefix + random_tokens(rng, length - len(prefix), vocab_size) for _ in range(count + 1)]
    return cold, warm
