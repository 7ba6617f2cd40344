"""A queueing model of a fleet from its cost profile: the search's first cut, which tells the simulation
where to look.

It prices a fleet from the trace's own requests (their prompts, outputs, arrival times and rate):

- **Decode** (a split fleet's decode workers, a colocated worker's decode rows): each worker holds the
  sequences Little's law gives (its arrival rate times a sequence's steps times a step's cost, which grows
  with the batch), solved as a fixed point. Its slots (max_running, or fewer when the KV memory holds fewer
  whole sequences) are servers. Below saturation a request waits for one as in an M/M/c queue (Erlang C),
  no longer than a critically loaded queue builds by its arrival, the trace starting empty; at or past
  saturation, as the fluid queue of the finite trace grows. A split request's wait is spread over its TPOT
  as the simulator's is.
- **Prefill** (split): a worker runs back-to-back steps while prompts wait, each step taking the prompts that
  arrived during the last one; the step's length is the fixed point of (prompts arriving during a step)
  times their tokens. A request waits for the step under way (when the worker is busy), then its own.
- **Colocated**: both at once: a step's decode rows plus the prompts that arrived during the step before,
  sharing its fixed cost.

Each request gets a TTFT and a TPOT (the waits drawn from fixed uniforms, so a fleet's prediction is a
function of its shape alone), and the attainment is the share meeting both. What it leaves out: the
routing's imbalance on small fleets, the fluctuation of a worker's batch around its mean, a KV transfer
overlapping anything. `python -m bench.planner_scale error` states its error against the simulation.
"""

import math
from dataclasses import dataclass

import numpy as np

from planner.profile import CostProfile
from planner.types import FleetShape, Mode, RequestSpec, Slo

ANALYTIC_LIMIT = 100_000  # workers of one kind the model searches up to (past the planner's own limit)
_FIXED_POINT_ROUNDS = 200


@dataclass(frozen=True)
class Prediction:
    fleet: FleetShape
    attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float


class FleetModel:
    """The queueing model of one trace's requests under one SLO: `predict` a fleet, or find the smallest."""

    def __init__(self, profile: CostProfile, requests: list[RequestSpec], slo: Slo, seed: int = 0) -> None:
        self.profile, self.slo = profile, slo
        self.prompt = np.array([r.prompt_tokens for r in requests], dtype=np.float64)
        self.uncached = np.array([max(0, r.prompt_tokens - r.cached_prompt_tokens) for r in requests], np.float64)
        self.output = np.array([r.output_tokens for r in requests], dtype=np.float64)
        self.arrival = np.array([r.arrival_s for r in requests], dtype=np.float64)
        span = requests[-1].arrival_s if len(requests) > 1 else 1.0
        self.rate = len(requests) / span if span > 0 else float(len(requests))
        self.mean_uncached = max(1.0, float(self.uncached.mean()))
        self.mean_output = float(self.output.mean())
        self.context = float((self.prompt + self.output / 2).mean())
        blocks = np.ceil((self.uncached + self.output) / profile.block_size).mean()
        # the FIFO head that does not fit leaves about one sequence's blocks free on a full worker
        capacity = profile.kv_capacity_tokens // profile.block_size
        self.slots = max(1, min(profile.max_running, int((capacity - blocks) // blocks)))
        rng = np.random.default_rng(seed)
        self.busy_draw, self.residual_draw, self.slot_draw = rng.random((3, len(requests)))
        self.walk_draw = rng.standard_normal(len(requests))
        self.kv = profile.kv_fixed_s + profile.kv_per_token_s * self.uncached
        self.shared = min(profile.prefill_step_s(1), profile.decode_step_s(1, self.context))

    # ---- one fleet ------------------------------------------------------------------------------

    def predict(self, fleet: FleetShape) -> Prediction:
        if fleet.mode is Mode.SPLIT:
            ttft, tpot = self.split_ttft(fleet.prefill), self.split_tpot(fleet.decode)
        else:
            ttft, tpot = self.colocated(fleet.colocated)
        met = (ttft <= self.slo.ttft_s) & (tpot <= self.slo.tpot_s)
        quantiles = [_quantile(values, q) for values in (ttft, tpot) for q in (0.5, 0.99)]
        return Prediction(fleet, float(met.mean()), *quantiles)

    def split_ttft(self, prefill: int) -> np.ndarray:
        """Each request's TTFT on `prefill` prefill workers (inf where they cannot keep up)."""
        per_worker = self.rate / prefill
        step = self._prefill_step(per_worker)
        if step is None:
            return np.full(len(self.prompt), math.inf)
        batch = max(1.0, per_worker * step)
        busy = min(1.0, per_worker * step)
        wait = np.where(self.busy_draw < busy, self.residual_draw * step, 0.0)
        own = self._prefill_array(self.uncached + (batch - 1) * self.mean_uncached)
        return self.profile.ttft_overhead_for(Mode.SPLIT) + wait + own

    def split_tpot(self, decode: int) -> np.ndarray:
        """Each request's TPOT on `decode` decode workers (inf where they cannot keep up)."""
        per_worker = self.rate / decode
        step = self._fixed_point(lambda t: self.profile.decode_step_s(self._rows(per_worker, t), self.context))
        wait = self._slot_wait(decode, step)
        if step is None or wait is None:
            return np.full(len(self.prompt), math.inf)
        assert step is not None
        handoff = self.kv + step / 2 + wait
        steps = np.maximum(self.output - 1, 1)
        tpot = step + handoff / steps + self.profile.per_token_overhead_s
        return np.where(self.output > 1, tpot, 0.0)

    def colocated(self, workers: int) -> tuple[np.ndarray, np.ndarray]:
        """Each request's TTFT and TPOT on `workers` colocated workers (inf where they cannot keep up)."""
        per_worker, profile = self.rate / workers, self.profile

        def step_of(t: float) -> float:
            prompts = per_worker * t  # prompts arriving during a step, computed in the next
            decode = profile.decode_step_s(self._rows(per_worker, t), self.context)
            if prompts >= 1:
                return decode + self._prefill(prompts * self.mean_uncached) - self.shared
            return decode + prompts * (self._prefill(self.mean_uncached) - self.shared)

        step = self._fixed_point(step_of)
        wait = self._slot_wait(workers, step)
        n = len(self.prompt)
        if step is None or wait is None:
            return np.full(n, math.inf), np.full(n, math.inf)
        rows = self._rows(per_worker, step)
        batch = max(1.0, per_worker * step)
        tokens = self.uncached + (batch - 1) * self.mean_uncached
        chunks = np.ceil(tokens / max(1.0, profile.token_budget - rows))
        decode = profile.decode_step_s(rows, self.context)
        own = self._prefill_array(tokens) + chunks * (decode - self.shared)
        residual = self.residual_draw * step
        ttft = profile.ttft_overhead_for(Mode.COLOCATED) + wait + residual + own
        tpot = np.where(self.output > 1, step + profile.per_token_overhead_s, 0.0)
        return ttft, tpot

    # ---- the smallest fleets ----------------------------------------------------------------------

    def smallest_colocated(self, attainment: float) -> Prediction | None:
        count = _smallest(lambda n: self.predict(FleetShape(Mode.COLOCATED, colocated=n)).attainment >= attainment)
        return None if count is None else self.predict(FleetShape(Mode.COLOCATED, colocated=count))

    def smallest_split(self, attainment: float) -> Prediction | None:
        """The smallest prefill count with TTFT met (decode unbounded) and decode count with TPOT met, then
        both grown together until the pair meets the target."""
        slo = self.slo
        prefill = _smallest(lambda n: float((self.split_ttft(n) <= slo.ttft_s).mean()) >= attainment)
        decode = _smallest(lambda n: float((self.split_tpot(n) <= slo.tpot_s).mean()) >= attainment)
        if prefill is None or decode is None:
            return None
        while prefill + decode <= 2 * ANALYTIC_LIMIT:
            found = self.predict(FleetShape(Mode.SPLIT, prefill=prefill, decode=decode))
            if found.attainment >= attainment:
                return found
            prefill, decode = prefill + max(1, prefill // 100), decode + max(1, decode // 100)
        return None

    # ---- pieces ---------------------------------------------------------------------------------

    def _rows(self, per_worker: float, step: float) -> float:
        """Sequences decoding on a worker (Little's law), at most its slots."""
        return min(float(self.slots), max(1.0, per_worker * self.mean_output * step))

    def _slot_wait(self, workers: int, step: float | None) -> np.ndarray | None:
        """Each request's wait for a decode slot; None when the step cannot be priced.

        Below saturation, a worker's slots are an M/M/c queue (Erlang C), its wait no longer than a
        critically loaded queue builds by the request's arrival (the trace starts empty). At or past it, the
        fluid queue of a finite trace: the fleet's slots fill, then the queue grows by (load - 1) seconds of
        wait per second."""
        if step is None:
            return None
        lifetime = self.mean_output * step
        servers, offered = self.slots, self.rate / workers * lifetime
        since_full = np.maximum(0.0, self.arrival - workers * servers / self.rate)
        # a critically loaded queue's wait, the routing pooling the fleet's slots: |N(0, 2 t L / c)|
        building = np.abs(self.walk_draw) * np.sqrt(2 * since_full * lifetime / (workers * servers))
        if offered >= servers:
            return np.maximum(building, (offered / servers - 1) * since_full)
        queued = _erlang_c(servers, offered)
        if queued <= 0:
            return np.zeros_like(self.slot_draw)
        drain = (servers - offered) / lifetime
        tail = np.clip((1 - self.slot_draw) / queued, 1e-300, 1.0)
        steady = np.where(self.slot_draw > 1 - queued, -np.log(tail) / drain, 0.0)
        return np.minimum(steady, building)

    def _prefill_step(self, per_worker: float) -> float | None:
        """A busy prefill worker's step: the prompts arriving during one are the next one's."""
        return self._fixed_point(lambda t: self._prefill(max(1.0, per_worker * t) * self.mean_uncached))

    def _fixed_point(self, step_of) -> float | None:
        """The step length t with step_of(t) == t, iterated up from the lightest step; None when it grows
        without bound (the worker cannot keep up)."""
        t = step_of(0.0)
        for _ in range(_FIXED_POINT_ROUNDS):
            following = step_of(t)
            if abs(following - t) <= 1e-9 * max(t, 1e-9):
                return following
            if following > 1e6:
                return None
            t = following
        return t if step_of(t) <= t * 1.001 else None

    def _prefill(self, tokens: float) -> float:
        full, rest = divmod(tokens, self.profile.token_budget)
        return full * self.profile.prefill_step_s(self.profile.token_budget) + self.profile.prefill_step_s(int(rest))

    def _prefill_array(self, tokens: np.ndarray) -> np.ndarray:
        full, rest = np.divmod(np.floor(tokens), self.profile.token_budget)
        values, where = np.unique(rest, return_inverse=True)
        partial = np.array([self.profile.prefill_step_s(int(v)) for v in values])[where]
        return full * self.profile.prefill_step_s(self.profile.token_budget) + partial


def _smallest(meets) -> int | None:
    """The smallest count in [1, ANALYTIC_LIMIT] that meets (assumed monotone); None if none does."""
    if not meets(ANALYTIC_LIMIT):
        return None
    low, high = 0, 1
    while not meets(high):
        low, high = high, high * 2
    high = min(high, ANALYTIC_LIMIT)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high


def _quantile(values: np.ndarray, q: float) -> float:
    """As the search's: the smallest value at least a share `q` of the values are at or below."""
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)])


def _erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits in an M/M/c queue of `servers` at `offered` load (Erlang B's recursion)."""
    if servers - offered > 8 * math.sqrt(offered) + 8:
        return 0.0  # far from the Halfin-Whitt regime: below 1e-13
    blocked = 1.0
    for k in range(1, servers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return servers * blocked / (servers - offered * (1 - blocked))
