"""What a fleet is asked to serve: Poisson arrivals at a rate, prompt and output lengths drawn uniformly from
a range, and a share of requests opening with a shared prefix that the workers hold cached.

Presets name the mixes the planner is usually asked about. Their SLOs are scales of the profile's own costs
(how long the mean prompt takes to compute alone, how long a lone sequence's decode step takes), so a preset
asks the same question of a slow CPU profile and of a fast accelerator one.
"""

import math
import random
from dataclasses import dataclass, replace

from planner.profile import CostProfile
from planner.types import RequestSpec, Slo


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn uniformly from [low, high]; a fixed length when low == high."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a length range needs 1 <= low <= high, not [{self.low}, {self.high}]")

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    @classmethod
    def parse(cls, text: str) -> "Lengths":
        """ "256" (fixed) or "128-512" (uniform)."""
        low, _, high = text.partition("-")
        try:
            lengths = cls(int(low), int(high or low))
        except ValueError as error:
            raise ValueError(f"{text!r} is not a token count (256) or range (128-512): {error}") from None
        return lengths


@dataclass(frozen=True)
class Workload:
    rate_per_s: float
    prompt: Lengths
    output: Lengths
    requests: int = 2000
    prefix_share: float = 0.0  # the share of requests that open with the shared prefix
    prefix_tokens: int = 0  # the shared prefix's length; a request's last prompt token is never cached
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0:
            raise ValueError(f"the arrival rate must be positive requests per second, not {self.rate_per_s}")
        if self.requests < 1:
            raise ValueError(f"a workload needs at least one request, not {self.requests}")
        if not 0 <= self.prefix_share <= 1:
            raise ValueError(f"the prefix share is a fraction in [0, 1], not {self.prefix_share}")
        if self.prefix_tokens < 0:
            raise ValueError(f"the prefix length must be >= 0 tokens, not {self.prefix_tokens}")

    def at_rate(self, rate_per_s: float) -> "Workload":
        return replace(self, rate_per_s=rate_per_s)

    def lasting(self, seconds: float) -> "Workload":
        """The workload with enough requests for its arrivals to span `seconds` (never fewer than now)."""
        return replace(self, requests=max(self.requests, math.ceil(self.rate_per_s * seconds)))

    def lone_request_s(self, profile: CostProfile) -> float:
        """How long a mean request takes on an idle worker: its prompt, then its output one step a token."""
        prompt, output = round(self.prompt.mean), self.output.mean
        return prefill_alone_s(profile, prompt) + output * profile.decode_step_s(1, prompt + output / 2)

    def sample(self) -> list[RequestSpec]:
        """The requests, in arrival order; the same seed gives the same requests."""
        rng = random.Random(self.seed)
        now = 0.0
        specs = []
        for _ in range(self.requests):
            now += rng.expovariate(self.rate_per_s)
            prompt = self.prompt.draw(rng)
            output = self.output.draw(rng)
            shares = rng.random() < self.prefix_share
            cached = min(self.prefix_tokens, prompt - 1) if shares else 0
            specs.append(RequestSpec(now, prompt, output, cached))
        return specs


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    prompt: Lengths
    output: Lengths
    rate_per_s: float  # a starting rate; the search moves it
    ttft_scale: float  # the TTFT SLO, in times the mean prompt's compute alone (with the TTFT overhead)
    tpot_scale: float  # the TPOT SLO, in times a lone sequence's decode step (with the per-token overhead)
    prefix_share: float = 0.0
    prefix_tokens: int = 0

    def workload(self, requests: int = 2000, seed: int = 0, rate_per_s: float | None = None) -> Workload:
        return Workload(
            rate_per_s or self.rate_per_s,
            self.prompt,
            self.output,
            requests,
            self.prefix_share,
            self.prefix_tokens,
            seed,
        )

    def slo(self, profile: CostProfile) -> Slo:
        return slo_for(profile, self.prompt, self.output, self.ttft_scale, self.tpot_scale)


def slo_for(profile: CostProfile, prompt: Lengths, output: Lengths, ttft_scale: float, tpot_scale: float) -> Slo:
    prefill_alone = prefill_alone_s(profile, round(prompt.mean)) + profile.ttft_overhead_s
    decode_alone = profile.decode_step_s(1, prompt.mean + output.mean / 2) + profile.per_token_overhead_s
    return Slo(ttft_s=ttft_scale * prefill_alone, tpot_s=tpot_scale * decode_alone)


def prefill_alone_s(profile: CostProfile, tokens: int) -> float:
    """A lone prompt's compute: whole steps of the token budget, then the rest."""
    full, rest = divmod(tokens, profile.token_budget)
    return full * profile.prefill_step_s(profile.token_budget) + profile.prefill_step_s(rest)


PRESETS = {
    preset.name: preset
    for preset in (
        Preset(
            "summarize",
            "long prompts, short outputs, tight TTFT and TPOT (prefill-heavy)",
            prompt=Lengths(1024, 2048),
            output=Lengths(16, 64),
            rate_per_s=1.0,
            ttft_scale=3.0,
            tpot_scale=2.0,
        ),
        Preset(
            "chat",
            "short prompts, long outputs, loose TTFT and TPOT (decode-heavy)",
            prompt=Lengths(16, 64),
            output=Lengths(128, 512),
            rate_per_s=1.0,
            ttft_scale=100.0,
            tpot_scale=4.0,
        ),
        Preset(
            "code",
            "mid prompts sharing a long prefix, short outputs, tight TTFT",
            prompt=Lengths(512, 1536),
            output=Lengths(32, 128),
            rate_per_s=1.0,
            ttft_scale=3.0,
            tpot_scale=3.0,
            prefix_share=0.8,
            prefix_tokens=384,
        ),
    )
}
