"""The engine loop: schedule a step, run it on the forward thread, update from its output, repeat.

One engine serves every role. A prefill worker's requests are `prefill_only` (they stop after the first
token) and its KV connector streams their KV out as it is computed; a decode worker's connector loads
the KV its requests received; a colocated request runs both phases here, with the null connector (it moves
no KV; the engine then skips the connector's per-step hooks).

A step is three parts, as in vLLM's engine: the scheduler decides it (`Scheduler.schedule`, on the event
loop); the forward thread executes it (`_execute`: the connector's loads, the forward pass, the connector's
saves, the sampler once over every row, verifying drafts and proposing the next ones); the output
processor updates from its output (`OutputProcessor.update`, on the event loop: tokens handed out, stop
checks, the prefix cache's names, requests that ended removed).

Asynchronous scheduling (`EngineConfig.async_scheduling`, on by default): step N+1 is scheduled and
launched while step N runs, and N's outputs are processed while N+1 runs, so the device does not wait for
the host's scheduling and updates, nor the host for the device. The scheduler takes it that each request
sampling in N gets one token there: N+1's input for it holds a placeholder, which the forward thread fills
with N's pick before it runs N+1 (it made that pick: nothing more to wait for; the step's one wait for the
device stays the copy of its picks). A request that finished in N (a stop token, max_tokens, an abort, a
failure) has its token from N+1 discarded: never emitted, never counted (`workers.engine.output`). The
scheduler gives no chunk to a request whose token in N is surely its last (a prefill-only request's first,
its max_tokens-th, the context's last), nor to an aborted one, which leaves once no step holds it.

What runs ahead and what does not. The engine schedules the next step before a step's outputs are
processed unless that step (a) samples for a request whose next input or logits need host work on this
token first: a grammar (its next mask follows the token through llguidance on the host) or drafts
(speculative decoding proposes the next step's drafts from this step's tokens); or (b) loads KV through the
connector (the KV tier counts a step's loads between its `build_meta` and its `before_update`). Such a
step is synchronous: the next is scheduled once its outputs are processed. Made safe to run ahead instead:
logit_bias and logprobs (the logprobs cross in the step's one copy); penalties (the sampler keeps each
request's output counts on the device and counts each pick there); seeded draws (by token index, which
counts the placeholder); prefill-only requests (never scheduled past their first token; their KV saves
name blocks by chunk position); blocks and the connectors. A request preempted, finished or failed while
the step after holds it leaves at once: its blocks can go only to steps scheduled later, which the forward
thread runs after that one (a prefill connector waits for their sends first, `wait_for_save`), and that
step gives a connector nothing of it to read (a prefill-only request is not in it; a failed request's
placeholder is left out). An aborted request leaves once no step holds it. A step that fails as a whole
fails its requests once the step after it, which may still compute for them, is done.
"""

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from workers.engine.connector import KvConnector, TierStats
from workers.engine.kv_cache_manager import KVCacheManager, draft_blocks
from workers.engine.output import (
    OutputProcessor,
    RequestHandle,
    Sampled,
    StepResult,
    TokenOutput,
    finishes,
    until_stop,
)
from workers.engine.request import BATCH, INTERACTIVE, EngineRequest, RequestFailed
from workers.engine.sampler import Sampler, SamplingRow
from workers.engine.sampling import StopCriteria
from workers.engine.schedule import ScheduledChunk, SchedulerOutput
from workers.engine.scheduler import Scheduler
from workers.models.step import StepInput
from workers.runner.model_runner import ModelRunner
from workers.spec_decode.build import build_proposer
from workers.spec_decode.config import SpecConfig
from workers.spec_decode.proposer import DraftRequest
from workers.spec_decode.verify import Verdict, verify

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestFailed", "RequestHandle", "RequestRejected", "TokenOutput"]

log = logging.getLogger(__name__)

PLACEHOLDER = -1  # the token id a step's input holds for the pick of the step before, until the forward thread has it


class RequestRejected(Exception):
    """A request this engine can never serve as given; the message says why."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: as many as kv_cache_mib holds
    kv_cache_mib: int = 256
    token_budget: int = 512  # tokens per step, prompt chunks and decoding tokens together
    max_running: int = 64
    enable_prefix_caching: bool = True
    device: str = "cpu"
    cuda_graphs: bool = True  # on CUDA devices, replay decode steps from captured graphs
    attention: str = "auto"  # the attention backend (workers.models.backends)
    speculative: SpecConfig | None = None  # draft tokens on decoding requests and verify them (off: None)
    async_scheduling: bool = True  # schedule each step while the one before runs (off: one step at a time)


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds and has done, at one moment: the worker's load reports derive from it."""

    running: int
    waiting_interactive: int
    waiting_batch: int
    prompt_tokens_pending: int  # of queued and running requests: the prefill work ahead
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    prefix_cache_version: int  # grows whenever the set of named blocks changes
    prefix_cache_hashes: tuple[int, ...]
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    tokens_generated: int
    prompt_tokens_computed: int
    steps: int
    kv_bytes_sent_by_path: dict[str, int]  # KV bytes delivered to decode workers, by data path
    kv_bytes_received_by_path: dict[str, int]
    draft_tokens_proposed: int = 0  # speculative decoding: drafts verified in a step
    draft_tokens_accepted: int = 0  # of those, the ones equal to the target's own pick
    tier: TierStats = field(default_factory=TierStats)  # the shared KV tier's (all 0 without one)

    @property
    def waiting(self) -> int:
        return self.waiting_interactive + self.waiting_batch

    @property
    def kv_bytes_sent(self) -> int:
        return sum(self.kv_bytes_sent_by_path.values())

    @property
    def kv_bytes_received(self) -> int:
        return sum(self.kv_bytes_received_by_path.values())


@dataclass
class _StepWork:
    """One step as the forward thread runs it, made on the event loop when the step is launched."""

    out: SchedulerOutput
    inputs: list[StepInput]  # one per chunk, in order
    rows: list[list[SamplingRow]]  # per chunk: one per position that samples (none: the chunk does not sample)
    awaiting: list[str | None]  # per chunk: the request whose pick in the step before is its last token
    departed: list[str]  # requests that left since the last step was launched: the sampler forgets them


@dataclass
class _StepUnderWay:
    out: SchedulerOutput
    result: asyncio.Future[StepResult]
    runs_ahead: bool  # whether the next step may be scheduled before this one's outputs are processed


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, stop: StopCriteria, executor: Executor) -> None:
        num_blocks = runner.num_blocks  # the runner's pool, sized by workers.main.build_engine
        self.runner = runner
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.token_budget, config.max_running, context_length=stop.context_length)
        self.connector: KvConnector = self.scheduler.connector  # KV that crosses workers: see attach_connector
        self._moves_kv = self.connector.moves_kv  # read once: False skips the connector's per-step hooks
        self.output = OutputProcessor(self.scheduler, stop, self._changed)
        self.sampler = Sampler()  # the forward thread's
        self._stop = stop
        self._executor = executor
        self._wakeup = asyncio.Event()
        self._load_watchers: set[asyncio.Event] = set()
        self._counted: dict[str, EngineRequest] = {}  # penalized requests whose output the sampler counts
        self._last_picks: dict[str, int] = {}  # the forward thread's: each request's last token in the last step
        self.steps_run = 0
        # called as on_step(tokens, milliseconds) after every step (metrics, benchmarks): the tokens it computed
        # for requests still here, its time on the forward thread
        self.on_step: Callable[[int, float], None] | None = None
        # called as on_logits(requests, logits) on the forward thread before sampling (benchmarks); a
        # request with drafts has one row per draft more
        self.on_logits: Callable[[list[EngineRequest], torch.Tensor], None] | None = None
        spec = config.speculative
        self.proposer = build_proposer(spec, runner.config.vocab_size, config.device, draft_blocks) if spec else None

    @property
    def tokens_generated(self) -> int:
        return self.output.tokens_generated

    @property
    def prompt_tokens_computed(self) -> int:
        return self.output.prompt_tokens_computed

    @property
    def draft_tokens_proposed(self) -> int:
        return self.output.draft_tokens_proposed

    @property
    def draft_tokens_accepted(self) -> int:
        return self.output.draft_tokens_accepted

    def attach_connector(self, connector: KvConnector) -> None:
        """Gives the engine its KV connector (several composed: `workers.kv_connector.multi`), before its
        first request (the connector is built for the runner's KV layout and pool, which are known once the
        engine is); until then it has the null connector."""
        if self.output.handles or self.steps_run:
            raise RuntimeError("attach the KV connector before the engine takes its first request")
        self.connector = connector
        self.scheduler.connector = connector
        self._moves_kv = connector.moves_kv

    # ---- requests -------------------------------------------------------------------------------

    async def submit(self, request: EngineRequest) -> RequestHandle:
        """Queues a request once the connector prepared it (fetched the KV it may load); as `add`."""
        await self.connector.prepare(request)
        try:
            handle = self.add(request)
        except BaseException:
            self.connector.discard(request)
            raise
        if request.request_id not in self.output.handles:  # failed at once: never queued
            self.connector.discard(request)
        return handle

    def add(self, request: EngineRequest) -> RequestHandle:
        """Queues a request. Raises RequestRejected when it can never be served as given (and the
        connector's KvTransferError when the KV it should load is not there)."""
        if request.request_id in self.output.handles:
            raise RequestRejected(f"request {request.request_id} is already running on this worker")
        if not request.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        longest = min(request.num_tokens + request.sampling.max_tokens, self._stop.context_length)
        if not self.scheduler.fits_alone(longest):
            raise RequestRejected(
                f"the request may need {longest} tokens of KV, more than this worker's whole KV memory "
                f"({self.kv.num_blocks * self.kv.block_size} tokens); lower max_tokens or shorten the prompt"
            )
        handle = RequestHandle(request)
        if (unknown := self._unknown_token(request) or self._bad_controls(request)) is not None:
            handle.outputs.put_nowait(RequestFailed(unknown))  # it would fail its whole batch's forward pass
            return handle
        handle.kv_sent = self.connector.add_request(request)
        self.output.handles[request.request_id] = handle
        self.scheduler.add(request)
        self._changed()
        return handle

    def _unknown_token(self, request: EngineRequest) -> str | None:
        """Why the request holds a token id the model has no embedding for, or None."""
        vocab_size = self.runner.config.vocab_size
        for index, token_id in enumerate(request.all_token_ids):
            if not 0 <= token_id < vocab_size:
                return (
                    f"its token {index} (prompt and tokens already produced) is {token_id}, not a token of this "
                    f"model's vocabulary (0 to {vocab_size - 1}); send the ids of this model's tokenizer"
                )
        return None

    def _bad_controls(self, request: EngineRequest) -> str | None:
        """Why the request's logit_bias or penalties cannot apply to this model's logits, or None (the
        gateway refuses these; a worker called directly checks them too)."""
        sampling, vocab_size = request.sampling, self.runner.config.vocab_size
        for token_id, value in sampling.logit_bias:
            if not 0 <= token_id < vocab_size or not math.isfinite(value):
                return f"its logit_bias {token_id}: {value} needs a token id below {vocab_size} and a finite bias"
        if not (math.isfinite(sampling.presence_penalty) and math.isfinite(sampling.frequency_penalty)):
            return "its presence_penalty and frequency_penalty must be finite numbers"
        return None

    def abort(self, request_id: str) -> None:
        """Stops a request: it gets nothing more, and its blocks are freed once no step under way computes
        for it."""
        handle = self.output.handles.get(request_id)
        if handle is not None:
            self.output.abort(handle.request)
            self._wakeup.set()

    def stats(self) -> EngineStats:
        kv, scheduler = self.kv, self.scheduler
        transfers = self.connector.stats()
        return EngineStats(
            running=len(scheduler.running),
            waiting_interactive=scheduler.waiting_count(INTERACTIVE),
            waiting_batch=scheduler.waiting_count(BATCH),
            prompt_tokens_pending=scheduler.prompt_tokens_pending,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            block_size=kv.block_size,
            prefix_cache_version=kv.pool.version,
            prefix_cache_hashes=tuple(kv.cached_block_hashes()),
            prefix_cache_hit_tokens=kv.hits_tokens,
            prefix_cache_queried_tokens=kv.queried_tokens,
            tokens_generated=self.tokens_generated,
            prompt_tokens_computed=self.prompt_tokens_computed,
            steps=self.steps_run,
            kv_bytes_sent_by_path=transfers.sent_by_path,
            kv_bytes_received_by_path=transfers.received_by_path,
            draft_tokens_proposed=self.draft_tokens_proposed,
            draft_tokens_accepted=self.draft_tokens_accepted,
            tier=transfers.tier or TierStats(),
        )

    def load_changed(self) -> None:
        """Wakes the load watchers (the worker's own state, such as draining, changed)."""
        self._changed()

    def watch_load(self) -> asyncio.Event:
        """An event set whenever the load changes; pass it to unwatch_load when done."""
        event = asyncio.Event()
        self._load_watchers.add(event)
        return event

    def unwatch_load(self, event: asyncio.Event) -> None:
        self._load_watchers.discard(event)

    # ---- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        under_way: _StepUnderWay | None = None
        while True:
            if under_way is None:
                await self._wakeup.wait()
            elif not under_way.runs_ahead:
                await self._update(under_way)
                under_way = None
            self.output.drop_aborted(under_way.out if under_way is not None else None)
            out = self.scheduler.schedule()
            if not out.chunks:
                if under_way is not None:
                    await self._update(under_way)
                    under_way = None
                else:
                    self._wakeup.clear()
                continue
            launched = self._launch(out)
            if under_way is not None:
                await self._update(under_way, then=launched)
            under_way = launched

    def _launch(self, out: SchedulerOutput) -> _StepUnderWay:
        """Hands the step to the forward thread; from now on its tokens count as computed."""
        work = self._work(out)
        self.scheduler.commit(out)
        runs_ahead = self.config.async_scheduling and self._may_run_ahead(out)
        result = asyncio.get_running_loop().run_in_executor(self._executor, self._execute, work)
        return _StepUnderWay(out, result, runs_ahead)

    async def _update(self, step: _StepUnderWay, then: _StepUnderWay | None = None) -> None:
        """Waits for the step and processes its outputs; `then`: the step launched after it, if any."""
        try:
            result = await step.result
        except Exception as error:  # a failed step fails its requests, never the engine
            log.exception("engine step failed")
            if then is not None:
                await asyncio.wait([then.result])  # it may compute for this step's requests: they leave after it
            self._connector_step_done(step.out)
            self.output.fail_step(step.out, error)
            self._changed()
            return
        self._connector_step_done(step.out)
        self.steps_run += 1
        tokens = self.output.account(step.out, result.step_ms)
        if self.on_step is not None:
            self.on_step(tokens, result.step_ms)
        if self._moves_kv:
            self.connector.before_update(step.out)
        self.output.update(step.out, result.sampled)
        if self._moves_kv:
            await self.connector.after_update(step.out)
        self._changed()

    def _may_run_ahead(self, out: SchedulerOutput) -> bool:
        """Whether the step after `out` may be scheduled before out's outputs are processed (the rule is in
        the module's docstring)."""
        if out.kv_connector_meta.loads_kv():
            return False
        drafting = self.proposer is not None and self.config.speculative is not None
        for chunk in out.chunks:
            request = chunk.request
            sampled_here = chunk.samples and not request.prefill_only
            if sampled_here and (request.constraint is not None or (drafting and _draftable(request))):
                return False
        return True

    def _connector_step_done(self, out: SchedulerOutput) -> None:
        if self._moves_kv:
            self.connector.step_done(out.kv_connector_meta)

    # ---- a step's inputs, made on the event loop ------------------------------------------------------

    def _work(self, out: SchedulerOutput) -> _StepWork:
        """The runner's input and the sampler's rows of each chunk; a chunk whose last token is the pick of
        the step under way holds a placeholder for it."""
        inputs: list[StepInput] = []
        rows: list[list[SamplingRow]] = []
        awaiting: list[str | None] = []
        for chunk in out.chunks:
            request, drafts = chunk.request, chunk.draft_token_ids
            end = chunk.start + chunk.num_tokens - len(drafts)
            tokens = request.tokens_between(chunk.start, end)
            placeholder = end > request.num_tokens
            if placeholder:
                tokens.append(PLACEHOLDER)
            block_ids = self.kv.block_ids(request.request_id)
            table = self.kv.block_tables[request.request_id]  # the runner writes only the ids added to it
            inputs.append(StepInput(tokens + drafts, chunk.start, block_ids, chunk.samples, len(drafts), table))
            rows.append(self._rows(chunk) if chunk.samples else [])
            awaiting.append(request.request_id if placeholder else None)
        return _StepWork(out, inputs, rows, awaiting, self._departed())

    def _rows(self, chunk: ScheduledChunk) -> list[SamplingRow]:
        """One row per position of the chunk that samples: its last token's, then each draft's. A penalized
        request's first row carries its output so far, from which the sampler counts on."""
        request = chunk.request
        first_index = request.sample_index + request.num_output_placeholders
        history = None
        if request.sampling.penalizes and self._counted.get(request.request_id) is not request:
            self._counted[request.request_id] = request
            history = tuple(request.generated_token_ids)
        params, constraint = request.sampling, request.constraint
        return [
            SamplingRow(request.request_id, params, first_index + j, history if j == 0 else None, constraint)
            for j in range(len(chunk.draft_token_ids) + 1)
        ]

    def _departed(self) -> list[str]:
        """The penalized requests that left since the last step, whose output counts the sampler drops."""
        departed, self.output.departed = self.output.departed, []
        gone = []
        for request in departed:
            if self._counted.get(request.request_id) is request:
                del self._counted[request.request_id]
                gone.append(request.request_id)
        return gone

    # ---- the forward thread -----------------------------------------------------------------------------

    def _execute(self, work: _StepWork) -> StepResult:
        """Runs on the forward thread: the connector's loads, the model, the connector's saves, the sampler
        over every row (verifying drafts) and drafting for the next step; returns, per chunk, what its request
        sampled or why it alone failed.
        Every tensor operation of the engine runs on this one thread: an operation on another thread
        would start a second OpenMP team whose spinning threads take cores from this one's."""
        started = time.monotonic()
        picks_before, self._last_picks = self._last_picks, {}
        self.sampler.forget(work.departed)
        kept = self._fill_placeholders(work, picks_before)
        connector, meta = self.connector, work.out.kv_connector_meta
        if self._moves_kv:
            connector.wait_for_save(meta)  # blocks freed since the last step may be overwritten now
            connector.load_kv(meta, self.runner)
        logits = self.runner.execute([work.inputs[index] for index in kept]) if kept else None
        if self._moves_kv:
            connector.save_kv(meta, self.runner)
        chunks = work.out.chunks
        sampled: list[Sampled | RequestFailed | None] = [None] * len(chunks)
        for index in set(range(len(chunks))) - set(kept):
            sampled[index] = RequestFailed("its step before failed")  # it failed with that step already
        sampling = [index for index in kept if work.rows[index]]
        if logits is not None and sampling:
            self._sample(work, sampling, logits, sampled)
        self._propose(chunks, sampled)
        self._last_picks = {
            chunk.request.request_id: result.tokens[-1]
            for chunk, result in zip(chunks, sampled, strict=True)
            if isinstance(result, Sampled)
        }
        return StepResult(sampled, (time.monotonic() - started) * 1000)

    def _fill_placeholders(self, work: _StepWork, picks_before: dict[str, int]) -> list[int]:
        """Writes the step before's picks into the inputs waiting on them; returns the chunks to run: all but
        those whose request has no pick (its step before failed for it, so it fails too)."""
        kept = []
        for index, request_id in enumerate(work.awaiting):
            if request_id is not None:
                pick = picks_before.get(request_id)
                if pick is None:
                    continue
                step = work.inputs[index]
                step.token_ids[len(step.token_ids) - 1 - step.num_draft_tokens] = pick
            kept.append(index)
        return kept

    def _sample(
        self, work: _StepWork, sampling: list[int], logits: torch.Tensor, sampled: list[Sampled | RequestFailed | None]
    ) -> None:
        """The sampler once over the rows of the sampling chunks, then each chunk's verdict on its drafts."""
        chunks = work.out.chunks
        if self.on_logits is not None:
            self.on_logits([chunks[index].request for index in sampling], logits)
        rows = self.sampler(logits, [row for index in sampling for row in work.rows[index]])
        first = 0
        for index in sampling:
            chunk, count = chunks[index], len(work.rows[index])
            own, first = rows[first : first + count], first + count
            verdict = verify(chunk.draft_token_ids, [row.token_id for row in own])
            if isinstance(verdict, RequestFailed):
                sampled[index] = verdict
                continue
            # the distribution at position j picked token j (an accepted draft is the pick it equals)
            result = (
                self._until_stop(chunk.request, verdict)
                if chunk.draft_token_ids
                else Sampled(verdict.tokens, verdict.num_accepted)
            )
            result.logprobs = [row.logprobs for row in own][: len(result.tokens)]
            sampled[index] = result

    def _until_stop(self, request: EngineRequest, verdict: Verdict) -> Sampled:
        """A verdict on drafts, cut after the first token that ends the request (`output.until_stop`)."""
        return until_stop(self._stop, request, verdict)

    def _propose(self, chunks: list[ScheduledChunk], sampled: list[Sampled | RequestFailed | None]) -> None:
        """Drafts, for every sampling request that decodes on, the tokens its next step verifies."""
        if self.proposer is None or self.config.speculative is None:
            return
        wanted = []
        for chunk, result in zip(chunks, sampled, strict=True):
            request = chunk.request
            if not isinstance(result, Sampled) or request.prefill_only or not _draftable(request):
                continue
            if finishes(self._stop, request, result.tokens[-1], request.sample_index + len(result.tokens))[0]:
                continue
            token_ids = request.all_token_ids + result.tokens
            # tokens it may still produce: the next step emits its accepted drafts and one more
            left = min(
                request.sampling.max_tokens - request.sample_index - len(result.tokens),
                self._stop.context_length - len(token_ids),
            )
            count = min(self.config.speculative.num_draft_tokens, left - 1)
            if count > 0:
                wanted.append((result, DraftRequest(request.request_id, token_ids, count)))
        try:
            proposals = self.proposer.propose([draft_request for _, draft_request in wanted])
        except Exception:
            log.exception("the draft proposer raised; this step's requests decode their next token without drafts")
            return
        for (result, draft_request), drafts in zip(wanted, proposals, strict=True):
            result.drafts = drafts[: draft_request.max_drafts]

    def _changed(self) -> None:
        self._wakeup.set()
        for event in self._load_watchers:
            event.set()


def _draftable(request: EngineRequest) -> bool:
    """Whether speculative drafts may run ahead of the request: not when its logits change token by token
    (logit_bias, penalties counting each accepted draft) nor when it wants logprobs."""
    sampling = request.sampling
    return not (sampling.adjusts_logits or sampling.logprobs or request.constraint is not None)
