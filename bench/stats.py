"""What one request saw, and the statistics the report prints: percentiles, throughput, goodput."""

import math
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class RequestResult:
    sent_at: float  # perf_counter seconds
    token_times: list[float] = field(default_factory=list)  # arrival of each output token
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    shares_prefix: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token answer."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_gaps(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met_by(self, result: RequestResult) -> bool:
        tpot = result.tpot
        return result.ok and result.ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


@dataclass(frozen=True)
class RunSummary:
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    ttft: tuple[float, float, float]  # p50, p90, p99 in seconds
    tpot: tuple[float, float, float]
    itl: tuple[float, float, float]
    output_tokens_per_s: float
    goodput_per_s: float
    prefix_hit_rate: float  # cached prompt tokens / prompt tokens
    ttft_p50_prefix_hit: float  # requests that found cached tokens
    ttft_p50_prefix_miss: float


def _p50_90_99(values: list[float]) -> tuple[float, float, float]:
    return percentile(values, 50), percentile(values, 90), percentile(values, 99)


def summarize(results: list[RequestResult], slo: Slo) -> RunSummary:
    done = [r for r in results if r.ok]
    start = min((r.sent_at for r in results), default=0.0)
    end = max((r.token_times[-1] for r in done), default=start)
    duration = max(end - start, 1e-9)
    output_tokens = sum(len(r.token_times) for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return RunSummary(
        requests=len(results),
        failed=len(results) - len(done),
        duration_s=duration,
        output_tokens=output_tokens,
        ttft=_p50_90_99([r.ttft for r in done]),
        tpot=_p50_90_99([t for r in done if (t := r.tpot) is not None]),
        itl=_p50_90_99([gap for r in done for gap in r.inter_token_gaps]),
        output_tokens_per_s=output_tokens / duration,
        goodput_per_s=sum(slo.met_by(r) for r in done) / duration,
        prefix_hit_rate=sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_prefix_hit=percentile([r.ttft for r in done if r.cached_tokens > 0], 50),
        ttft_p50_prefix_miss=percentile([r.ttft for r in done if r.cached_tokens == 0], 50),
    )
