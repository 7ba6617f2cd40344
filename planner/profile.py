"""What a worker's work costs on one kind of hardware, measured by `python -m bench.phase_costs`.

A profile is JSON:

    {"model": "diptych-100m", "hardware": "cpu-2core", "measured_with": "<the command>",
     "block_size": 16, "token_budget": 512, "max_running": 64, "kv_capacity_tokens": 65536,
     "prefill": [{"tokens": 16, "seconds": 0.004}, ...],                 # one step computing that many prompt tokens
     "decode": [{"batch": 1, "context": 128, "seconds": 0.02}, ...],     # one step of that many sequences
     "kv_transfer": {"fixed_seconds": 0.002, "seconds_per_token": 1e-5},  # prefill worker -> decode worker
     "overhead": {"ttft_seconds": 0.004, "per_token_seconds": 0.0003,    # gateway and gRPC, outside the engine
                  "split_ttft_seconds": 0.02},                          # optional: split fleets' own TTFT overhead
     "prefill_attention": {"seconds_per_token_pair": 5e-7}}              # optional: see below

Costs between the measured points are interpolated linearly and beyond them extrapolated from the last
two points, so a profile measured up to 2,048-token steps still prices a 4,096-token step.

A prefill point prices one prompt computed from its first token. A chunk that starts later in its prompt
attends over the chunks before it, and a step of several short prompts attends less than one long prompt
of the same total: `prefill_attention` prices that difference, per pair of (token computed, earlier token
of its sequence it attends to) (`step_s(..., chunks=...)`). A profile without it prices prompt tokens by
their count alone.
"""

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.types import Mode


@dataclass(frozen=True)
class CostProfile:
    model: str
    hardware: str
    measured_with: str
    block_size: int
    token_budget: int  # prompt tokens per engine step at most (longer prompts are chunked)
    max_running: int  # sequences per engine step at most
    kv_capacity_tokens: int  # tokens of KV cache one worker holds
    prefill_points: tuple[tuple[int, float], ...]  # (tokens, seconds), tokens ascending
    decode_points: tuple[tuple[int, int, float], ...]  # (batch, context, seconds), sorted
    kv_fixed_s: float
    kv_per_token_s: float
    ttft_overhead_s: float
    per_token_overhead_s: float
    attention_pair_s: float = 0.0  # seconds per (prompt token computed, earlier token of its sequence)
    split_ttft_overhead_s: float | None = None  # a split fleet's TTFT overhead, where measured apart

    def ttft_overhead_for(self, mode: Mode) -> float:
        """The TTFT overhead of a fleet of this mode: a split fleet's own where the profile measured it (its
        first token crosses the gateway while the decode worker computes beside the prefill worker)."""
        if mode is Mode.SPLIT and self.split_ttft_overhead_s is not None:
            return self.split_ttft_overhead_s
        return self.ttft_overhead_s

    def prefill_step_s(self, tokens: int) -> float:
        """One engine step computing `tokens` prompt tokens (and nothing else)."""
        if tokens <= 0:
            return 0.0
        return _interpolate([t for t, _ in self.prefill_points], [s for _, s in self.prefill_points], tokens)

    def decode_step_s(self, batch: float, context: float) -> float:
        """One engine step of `batch` decoding sequences whose mean context is `context` tokens (a mean
        batch, as the queueing model's, may be fractional: interpolated alike)."""
        if batch <= 0:
            return 0.0
        contexts = sorted({c for _, c, _ in self.decode_points})
        by_context = [self._decode_at_context(batch, c) for c in contexts]
        return max(0.0, _interpolate(contexts, by_context, context))

    def step_s(
        self, prefill_tokens: int, decode_batch: int, decode_context: float, chunks: Sequence[tuple[int, int]] = ()
    ) -> float:
        """A mixed step (colocated workers): the prompt tokens and the decode rows in one forward pass. The
        two parts share the step's fixed cost, counted once. `chunks`: the step's prompt chunks as (tokens,
        position of the chunk's first token in its prompt), when known: their attention is priced
        (`chunks_attention_s`)."""
        if not prefill_tokens:
            return self.decode_step_s(decode_batch, decode_context)
        prefill = self.prefill_step_s(prefill_tokens) + self.chunks_attention_s(chunks)
        if not decode_batch:
            return prefill
        shared = min(self.prefill_step_s(1), self.decode_step_s(1, decode_context))
        return prefill + self.decode_step_s(decode_batch, decode_context) - shared

    def chunks_attention_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """What a step's prompt chunks, (tokens, start position) each, cost beyond (or below)
        `prefill_step_s` of their total, which prices one prompt of that many tokens from position 0: each
        token attends over its chunk's start plus the tokens before it in the chunk."""
        if not chunks or not self.attention_pair_s:
            return 0.0
        total = sum(tokens for tokens, _ in chunks)
        pairs = sum(tokens * (start + tokens / 2) for tokens, start in chunks)
        return self.attention_pair_s * (pairs - total * total / 2)

    def kv_transfer_s(self, tokens: int) -> float:
        return self.kv_fixed_s + self.kv_per_token_s * tokens

    def _decode_at_context(self, batch: float, context: int) -> float:
        points = sorted((b, s) for b, c, s in self.decode_points if c == context)
        return _interpolate([b for b, _ in points], [s for _, s in points], batch)

    @classmethod
    def from_json(cls, data: dict) -> "CostProfile":
        kv, overhead = data["kv_transfer"], data["overhead"]
        return cls(
            model=data["model"],
            hardware=data["hardware"],
            measured_with=data.get("measured_with", ""),
            block_size=int(data["block_size"]),
            token_budget=int(data["token_budget"]),
            max_running=int(data["max_running"]),
            kv_capacity_tokens=int(data["kv_capacity_tokens"]),
            prefill_points=tuple(sorted((int(p["tokens"]), float(p["seconds"])) for p in data["prefill"])),
            decode_points=tuple(
                sorted((int(p["batch"]), int(p["context"]), float(p["seconds"])) for p in data["decode"])
            ),
            kv_fixed_s=float(kv["fixed_seconds"]),
            kv_per_token_s=float(kv["seconds_per_token"]),
            ttft_overhead_s=float(overhead["ttft_seconds"]),
            per_token_overhead_s=float(overhead["per_token_seconds"]),
            attention_pair_s=float(data.get("prefill_attention", {}).get("seconds_per_token_pair", 0.0)),
            split_ttft_overhead_s=float(split) if (split := overhead.get("split_ttft_seconds")) is not None else None,
        )

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "measured_with": self.measured_with,
            "block_size": self.block_size,
            "token_budget": self.token_budget,
            "max_running": self.max_running,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "prefill": [{"tokens": t, "seconds": s} for t, s in self.prefill_points],
            "decode": [{"batch": b, "context": c, "seconds": s} for b, c, s in self.decode_points],
            "kv_transfer": {"fixed_seconds": self.kv_fixed_s, "seconds_per_token": self.kv_per_token_s},
            "overhead": {
                "ttft_seconds": self.ttft_overhead_s,
                "per_token_seconds": self.per_token_overhead_s,
                **(
                    {"split_ttft_seconds": self.split_ttft_overhead_s} if self.split_ttft_overhead_s is not None else {}
                ),
            },
            "prefill_attention": {"seconds_per_token_pair": self.attention_pair_s},
        }


def save_profile(profile: CostProfile, path: Path) -> None:
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through the points; beyond either end, the nearest segment's line."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0]) if xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


MEASURE_COMMAND = "python -m bench.phase_costs --model diptych-100m --out planner/profiles/cpu-diptych-100m.json"


class ProfileError(Exception):
    """A cost profile that cannot be read or used; the message says which and why."""


def load_profile(path: Path) -> CostProfile:
    """The cost profile at `path`, checked whole: a missing, unreadable or unusable one is a ProfileError."""
    if not path.is_file():
        raise ProfileError(f"no cost profile at {path}; measure one with `{MEASURE_COMMAND}` or pass --profile")
    try:
        profile = CostProfile.from_json(json.loads(path.read_text()))
    except json.JSONDecodeError as error:
        raise ProfileError(f"{path} is not JSON: {error}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ProfileError(
            f"{path} is not a cost profile ({type(error).__name__}: {error}); see planner/profile.py"
        ) from None
    problem = _profile_problem(profile)
    if problem:
        raise ProfileError(f"{path} is not a usable cost profile: {problem}")
    return profile


def _profile_problem(profile: CostProfile) -> str:
    if not profile.prefill_points or not profile.decode_points:
        return "it needs at least one prefill and one decode measurement"
    if any(s <= 0 for _, s in profile.prefill_points) or any(s <= 0 for _, _, s in profile.decode_points):
        return "every measured step must take a positive time"
    if min(profile.block_size, profile.token_budget, profile.max_running, profile.kv_capacity_tokens) < 1:
        return "block_size, token_budget, max_running and kv_capacity_tokens must be positive"
    if profile.max_running > profile.token_budget:
        return "max_running must not exceed token_budget"
    costs = (profile.kv_fixed_s, profile.kv_per_token_s, profile.ttft_overhead_s, profile.per_token_overhead_s)
    if min(costs) < 0:
        return "the KV transfer and overhead costs must be >= 0"
    return ""
