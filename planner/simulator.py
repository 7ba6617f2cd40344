"""A discrete-event simulation of a fleet serving a request trace, priced by a measured cost profile.

Each worker runs the engine's loop: a step is planned when the worker is idle and has work, lasts what the
profile prices it at, and its tokens appear when it ends. A step is planned as the engine's scheduler plans
it: every decoding sequence gets one row, the request still in its prompt gets the next chunk of the budget
left, then waiting requests are admitted in arrival order while the token budget, the batch size
(max_running) and the KV memory last.

- Split fleets: a prefill worker computes the prompt's uncached tokens and emits the first token; the KV of
  those tokens reaches the request's decode worker `kv_transfer_s(uncached)` later; the decode worker admits
  it (one row, computing the first token) and it then emits one token per step until its last.
- Colocated fleets: a worker runs both phases; its steps mix prompt chunks with decode rows, priced by
  `step_s`, so a long prompt lengthens the step every decoding sequence on the worker waits for.
- Routing is the gateway's: the prefill (or colocated) worker with the fewest requests in flight, the decode
  worker with room for the whole sequence in its free KV, then the fewest in flight, then the most free KV.
  `RoutingOptions` turns on the gateway's split skip and prefill overflow.

What it simplifies: a sequence's KV is reserved whole (prompt and output, less its cached prefix) when it is
admitted, so the engine's preemption never happens; cached prefix tokens are held by every worker; a step
prices its prompt chunks as the profile does (their count, and where the profile measured it, the attention
of each chunk over the prompt tokens before it).
"""

import bisect
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.profile import CostProfile, _interpolate
from planner.types import FleetShape, Mode, RequestOutcome, RequestSpec

_STEP_DONE, _ARRIVAL, _KV_ARRIVED = 0, 1, 2
_PREFILL, _DECODE, _COLOCATED = "prefill", "decode", "colocated"
_UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class RoutingOptions:
    """The gateway's split skip and prefill overflow (`diptych gateway --skip-split-below`,
    `--prefill-overflow-tokens`); 0 turns each off, as here by default, so a split fleet always splits."""

    skip_split_below: int = 0
    prefill_overflow_tokens: int = 0
    queued_request_tokens: int = 128  # the work one waiting request stands for (gateway.routing.fleet_view)


@dataclass
class SimulationTotals:
    """What the fleet did in all: the checks of a run (every prompt token computed once, every output token
    emitted once)."""

    prompt_tokens_computed: int = 0
    output_tokens: int = 0
    steps: int = 0


class _Pricer:
    """The profile's `step_s`, the same numbers faster: its decode costs tabulated per batch size at the
    measured contexts (where the profile interpolates over context), its prefill costs remembered."""

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self.contexts = sorted({context for _, context, _ in profile.decode_points})
        self.by_batch: dict[int, list[float]] = {}
        self.prefill: dict[int, float] = {}
        self.prefill_one = profile.prefill_step_s(1)

    def decode_s(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        costs = self.by_batch.get(batch)
        if costs is None:
            costs = self.by_batch[batch] = [self.profile.decode_step_s(batch, c) for c in self.contexts]
        return max(0.0, _interpolate(self.contexts, costs, context))

    def decode_line(self, batch: int, context: float) -> tuple[float, float, int]:
        """A decode step's cost at `context` (as `decode_s`), what each further token of context adds to it,
        and for how many further tokens of context that line holds (the profile's segment of contexts)."""
        contexts = self.contexts
        costs = self.by_batch.get(batch)
        if costs is None:
            costs = self.by_batch[batch] = [self.profile.decode_step_s(batch, c) for c in contexts]
        if len(contexts) == 1:
            slope = costs[0] / contexts[0] if contexts[0] else 0.0
            return _interpolate(contexts, costs, context), slope, _UNBOUNDED
        i = min(max(bisect.bisect_left(contexts, context), 1), len(contexts) - 1)
        slope = (costs[i] - costs[i - 1]) / (contexts[i] - contexts[i - 1])
        room = math.floor(contexts[i] - context) if i < len(contexts) - 1 else _UNBOUNDED
        return _interpolate(contexts, costs, context), slope, room

    def prefill_s(self, tokens: int) -> float:
        cost = self.prefill.get(tokens)
        if cost is None:
            cost = self.prefill[tokens] = self.profile.prefill_step_s(tokens)
        return cost

    def step_s(self, chunks: list[tuple[int, int]], decode_batch: int, decode_context: float) -> float:
        """`chunks`: the step's prompt chunks, (tokens, position of the first in its prompt) each."""
        if not chunks:
            return self.decode_s(decode_batch, decode_context)
        prefill = self.prefill_s(sum(tokens for tokens, _ in chunks)) + self.profile.chunks_attention_s(chunks)
        if not decode_batch:
            return prefill
        decode = self.decode_s(decode_batch, decode_context)
        shared = min(self.prefill_one, self.decode_s(1, decode_context))
        return prefill + decode - shared


class _Job:
    """One request's stay on one worker."""

    __slots__ = ("blocks", "position", "prefill_only", "prompt_left", "request")

    def __init__(self, request: int, prompt_tokens: int, prompt_left: int, blocks: int, prefill_only: bool) -> None:
        self.request = request
        self.prompt_left = prompt_left  # 0: its KV was loaded (a decode worker's split request)
        self.position = prompt_tokens - prompt_left  # where its next chunk starts in its prompt
        self.blocks = blocks
        self.prefill_only = prefill_only


class _Worker:
    __slots__ = (
        "busy",
        "done_event",
        "finishes",
        "index",
        "offset_sum",
        "plan",
        "prompting",
        "role",
        "rows",
        "run",
        "step_no",
        "waiting",
    )

    def __init__(self, index: int, role: str) -> None:
        self.index = index
        self.role = role
        self.waiting: deque[_Job] = deque()
        self.prompting: list[_Job] = []  # admitted, prompt not all computed yet
        self.rows = 0  # decoding sequences
        self.offset_sum = 0  # sum over rows of (context - step number): mean context = this / rows + step
        self.finishes: list[tuple[int, int, int, int]] = []  # (last step, request, offset, blocks)
        self.step_no = 0
        self.plan: list[tuple[_Job, int]] = []
        self.busy = False
        # the steps under way: (start, first step's cost, cost added per step, steps). Steps that only decode,
        # with nothing to admit, follow one another unchanged until a sequence finishes or a request comes:
        # they run as one event, their cost growing with the context by the profile's line, cut short when a
        # request comes.
        self.run: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 1)
        self.done_event = 0  # the sequence number of its live step-done event (others are stale)


class _Simulation:
    def __init__(
        self, profile: CostProfile, requests: Sequence[RequestSpec], fleet: FleetShape, options: RoutingOptions
    ) -> None:
        self.profile = profile
        self.ttft_overhead_s = profile.ttft_overhead_for(fleet.mode)
        self.pricer = _Pricer(profile)
        self.requests = requests
        self.options = options
        self.budget = profile.token_budget
        self.max_running = profile.max_running
        self.block_size = profile.block_size
        roles = [_COLOCATED] * fleet.colocated if fleet.mode is Mode.COLOCATED else []
        if fleet.mode is Mode.SPLIT:
            roles = [_PREFILL] * fleet.prefill + [_DECODE] * fleet.decode
        self.workers = [_Worker(i, role) for i, role in enumerate(roles)]
        self.by_role = {
            role: np.array([w.index for w in self.workers if w.role == role], dtype=np.int64)
            for role in (_PREFILL, _DECODE, _COLOCATED)
        }
        capacity = profile.kv_capacity_tokens // profile.block_size
        self.capacity_blocks = capacity
        self.free_blocks = np.full(len(roles), capacity, dtype=np.int64)
        self.in_flight = np.zeros(len(roles), dtype=np.int64)
        self.backlog = np.zeros(len(roles), dtype=np.int64)  # prompt tokens routed, not at their first token
        count = len(requests)
        self.first = [math.nan] * count
        self.last = [math.nan] * count
        self.decode_worker = [-1] * count
        self.totals = SimulationTotals()
        self.events: list[tuple[float, int, int, int]] = []
        self.sequence = 0

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> list[RequestOutcome]:
        for index, spec in enumerate(self.requests):
            self._push(spec.arrival_s, _ARRIVAL, index)
        handlers = {_STEP_DONE: self._step_done, _ARRIVAL: self._arrive, _KV_ARRIVED: self._kv_arrived}
        events = self.events
        workers = self.workers
        while events:
            now, sequence, kind, ident = heapq.heappop(events)
            if kind == _STEP_DONE and sequence != workers[ident].done_event:
                continue  # a decode run cut short: its new end has its own event
            handlers[kind](ident, now)
        return [self._outcome(index, spec) for index, spec in enumerate(self.requests)]

    def _push(self, time: float, kind: int, ident: int) -> int:
        self.sequence += 1
        heapq.heappush(self.events, (time, self.sequence, kind, ident))
        return self.sequence

    def _outcome(self, index: int, spec: RequestSpec) -> RequestOutcome:
        first, last = self.first[index], self.last[index]
        if math.isnan(first) or math.isnan(last):
            raise RuntimeError(f"request {index} never finished: the simulation lost it")
        ttft = first - spec.arrival_s + self.ttft_overhead_s
        tpot = 0.0
        if spec.output_tokens > 1:
            tpot = (last - first) / (spec.output_tokens - 1) + self.profile.per_token_overhead_s
        return RequestOutcome(spec, ttft, tpot)

    # ---- routing (the gateway's) --------------------------------------------------------------------

    def _arrive(self, index: int, now: float) -> None:
        spec = self.requests[index]
        uncached = _uncached(spec)
        if len(self.by_role[_COLOCATED]):
            worker = self._least_in_flight(_COLOCATED)
            return self._whole_on(worker, index, spec, now)
        decode = self._pick_decode(spec)
        self.decode_worker[index] = decode
        options = self.options
        if options.skip_split_below and uncached <= options.skip_split_below:
            return self._whole_on(decode, index, spec, now)
        prefill = self._least_in_flight(_PREFILL)
        ahead = self.backlog[prefill]
        overflow = options.prefill_overflow_tokens
        if overflow and ahead >= overflow and self.backlog[decode] + uncached < ahead:
            return self._whole_on(decode, index, spec, now)
        self.in_flight[decode] += 1
        self.backlog[prefill] += uncached
        self._enqueue(
            prefill, _Job(index, spec.prompt_tokens, max(uncached, 1), self._blocks(spec, whole=False), True), now
        )

    def _whole_on(self, worker: int, index: int, spec: RequestSpec, now: float) -> None:
        self.backlog[worker] += _uncached(spec)
        self._enqueue(
            worker, _Job(index, spec.prompt_tokens, max(_uncached(spec), 1), self._blocks(spec, whole=True), False), now
        )

    def _least_in_flight(self, role: str) -> int:
        candidates = self.by_role[role]
        return int(candidates[np.argmin(self.in_flight[candidates])])

    def _pick_decode(self, spec: RequestSpec) -> int:
        candidates = self.by_role[_DECODE]
        free = self.free_blocks[candidates]
        need = math.ceil((spec.prompt_tokens + spec.output_tokens) / self.block_size)
        room = free >= need
        if not room.any():
            room[:] = True
        load = self.in_flight[candidates] * (self.capacity_blocks + 1) - free
        return int(candidates[np.argmin(np.where(room, load, np.iinfo(np.int64).max))])

    def _blocks(self, spec: RequestSpec, whole: bool) -> int:
        tokens = _uncached(spec) + (spec.output_tokens if whole else 0)
        return max(1, math.ceil(tokens / self.block_size))

    def _enqueue(self, worker: int, job: _Job, now: float) -> None:
        self.in_flight[worker] += 1
        state = self.workers[worker]
        state.waiting.append(job)
        self._wake(state, now)

    def _kv_arrived(self, index: int, now: float) -> None:
        spec = self.requests[index]
        worker = self.decode_worker[index]
        state = self.workers[worker]
        state.waiting.append(_Job(index, spec.prompt_tokens, 0, self._blocks(spec, whole=True), False))
        self._wake(state, now)

    def _wake(self, worker: _Worker, now: float) -> None:
        """A request came: an idle worker starts a step; a decode run stops after the step under way."""
        if not worker.busy:
            return self._start_step(worker, now)
        start, first, growth, steps = worker.run
        if steps > 1:
            under_way = _step_under_way(worker.run, now)
            if under_way < steps - 1:
                worker.run = (start, first, growth, under_way + 1)
                worker.done_event = self._push(_run_end(worker.run), _STEP_DONE, worker.index)

    # ---- engine steps -------------------------------------------------------------------------------

    def _start_step(self, worker: _Worker, now: float) -> None:
        step = worker.step_no + 1
        budget = self.budget - worker.rows
        plan: list[tuple[_Job, int]] = []
        for job in worker.prompting:
            if budget <= 0:
                break
            take = min(job.prompt_left, budget)
            plan.append((job, take))
            budget -= take
        running = worker.rows + len(worker.prompting)
        waiting, free = worker.waiting, self.free_blocks
        while budget > 0 and running < self.max_running and waiting:
            job = waiting[0]
            if job.blocks > free[worker.index]:
                break
            waiting.popleft()
            free[worker.index] -= job.blocks
            running += 1
            if job.prompt_left:
                worker.prompting.append(job)
                take = min(job.prompt_left, budget)
                plan.append((job, take))
                budget -= take
            else:  # loaded KV: one row computing its first token, the second token sampled
                spec = self.requests[job.request]
                self._join_rows(worker, job, step, spec.prompt_tokens + 1, spec.output_tokens - 1)
                budget -= 1
        if not plan and not worker.rows:
            return
        context = worker.offset_sum / worker.rows + step if worker.rows else 0.0
        if plan:
            chunks = [(take, job.position) for job, take in plan]
            worker.run = (now, self.pricer.step_s(chunks, worker.rows, context), 0.0, 1)
        else:
            first, growth, room = self.pricer.decode_line(worker.rows, context)
            steps = min(worker.finishes[0][0] - step + 1, room + 1)
            if first < 0 or first + growth * (steps - 1) < 0:  # the profile's clamp at 0 s: one step at a time
                first, growth, steps = max(0.0, first), 0.0, 1
            worker.run = (now, first, growth, steps)
        worker.step_no, worker.plan, worker.busy = step, plan, True
        worker.done_event = self._push(_run_end(worker.run), _STEP_DONE, worker.index)

    def _join_rows(self, worker: _Worker, job: _Job, first_step: int, context: int, tokens_left: int) -> None:
        """The job decodes from `first_step` on, one token per step, `tokens_left` tokens in all."""
        offset = context - first_step
        worker.rows += 1
        worker.offset_sum += offset
        heapq.heappush(worker.finishes, (first_step + tokens_left - 1, job.request, offset, job.blocks))

    def _step_done(self, index: int, now: float) -> None:
        worker = self.workers[index]
        steps = worker.run[3]
        step = worker.step_no = worker.step_no + steps - 1
        totals = self.totals
        totals.steps += steps
        totals.output_tokens += worker.rows * steps
        for job, take in worker.plan:
            totals.prompt_tokens_computed += take
            job.prompt_left -= take
            job.position += take
            if job.prompt_left == 0:
                worker.prompting.remove(job)
                self._prompt_done(worker, job, step, now)
        finishes = worker.finishes
        while finishes and finishes[0][0] <= step:
            _, request, offset, blocks = heapq.heappop(finishes)
            worker.rows -= 1
            worker.offset_sum -= offset
            self._finish(index, request, blocks, now)
        worker.plan, worker.busy = [], False
        self._start_step(worker, now)

    def _prompt_done(self, worker: _Worker, job: _Job, step: int, now: float) -> None:
        index = job.request
        spec = self.requests[index]
        self.first[index] = now
        self.totals.output_tokens += 1
        self.backlog[worker.index] -= _uncached(spec)
        if job.prefill_only:
            self.free_blocks[worker.index] += job.blocks
            self.in_flight[worker.index] -= 1
            if spec.output_tokens <= 1:
                self.in_flight[self.decode_worker[index]] -= 1
                self.last[index] = now
            else:
                self._push(now + self.profile.kv_transfer_s(_uncached(spec)), _KV_ARRIVED, index)
        elif spec.output_tokens <= 1:
            self._finish(worker.index, index, job.blocks, now)
        else:
            self._join_rows(worker, job, step + 1, spec.prompt_tokens + 1, spec.output_tokens - 1)

    def _finish(self, worker: int, request: int, blocks: int, now: float) -> None:
        self.last[request] = now
        self.free_blocks[worker] += blocks
        self.in_flight[worker] -= 1


def _run_end(run: tuple[float, float, float, int], step: int | None = None) -> float:
    """When step `step` (0: the first) of a run ends; by default its last."""
    start, first, growth, steps = run
    j = steps - 1 if step is None else step
    return start + (j + 1) * first + growth * j * (j + 1) / 2


def _step_under_way(run: tuple[float, float, float, int], now: float) -> int:
    """The run's first step that ends after `now`."""
    low, high = 0, run[3] - 1
    while low < high:
        middle = (low + high) // 2
        if _run_end(run, middle) > now:
            high = middle
        else:
            low = middle + 1
    return low


def simulate(
    profile: CostProfile,
    requests: Sequence[RequestSpec],
    fleet: FleetShape,
    options: RoutingOptions | None = None,
) -> list[RequestOutcome]:
    """Runs the requests on the fleet; one outcome per request, in the order given."""
    return simulate_with_totals(profile, requests, fleet, options)[0]


def simulate_with_totals(
    profile: CostProfile,
    requests: Sequence[RequestSpec],
    fleet: FleetShape,
    options: RoutingOptions | None = None,
) -> tuple[list[RequestOutcome], SimulationTotals]:
    _check(profile, requests, fleet)
    simulation = _Simulation(profile, requests, fleet, options or RoutingOptions())
    return simulation.run(), simulation.totals


def _uncached(spec: RequestSpec) -> int:
    return max(0, spec.prompt_tokens - spec.cached_prompt_tokens)


def _check(profile: CostProfile, requests: Sequence[RequestSpec], fleet: FleetShape) -> None:
    if fleet.mode is Mode.SPLIT and (fleet.prefill < 1 or fleet.decode < 1 or fleet.colocated):
        raise ValueError("a split fleet needs at least one prefill and one decode worker, and no colocated ones")
    if fleet.mode is Mode.COLOCATED and (fleet.colocated < 1 or fleet.prefill or fleet.decode):
        raise ValueError("a colocated fleet needs at least one colocated worker, and no prefill or decode ones")
    if profile.max_running > profile.token_budget:
        raise ValueError(
            f"the profile's max_running ({profile.max_running}) exceeds its token_budget ({profile.token_budget}): "
            "every decoding sequence must fit one step's budget"
        )
    capacity = profile.kv_capacity_tokens // profile.block_size * profile.block_size
    for index, spec in enumerate(requests):
        if spec.prompt_tokens < 1 or spec.output_tokens < 1 or not 0 <= spec.cached_prompt_tokens <= spec.prompt_tokens:
            raise ValueError(f"request {index} needs a prompt and an output of at least one token, cached part within")
        if spec.arrival_s < 0 or not math.isfinite(spec.arrival_s):
            raise ValueError(f"request {index} arrives at {spec.arrival_s}: arrivals are finite offsets >= 0")
        if _uncached(spec) + spec.output_tokens > capacity:
            raise ValueError(
                f"request {index} needs {_uncached(spec) + spec.output_tokens} tokens of KV, more than a worker's "
                f"whole KV memory ({capacity} tokens)"
            )
