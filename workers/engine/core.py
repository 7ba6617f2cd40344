"""The engine loop: schedule a step, run it on the model runner, sample, hand out tokens, repeat.

One engine serves every role. A prefill worker's requests are `prefill_only` (they stop after the first
token) and its KV connector streams their KV out as it is computed; a decode worker's connector loads
the KV its requests received; a colocated request runs both phases here, with no connector.
"""

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import BATCH, INTERACTIVE, EngineRequest, FinishReason, RequestStatus
from workers.engine.sampling import (
    SamplingParams,
    StopCriteria,
    TokenLogprobs,
    adjust_logits,
    draw,
    finite_rows,
    sample,
    token_logprobs,
)
from workers.engine.schedule import ScheduledChunk, SchedulerOutput
from workers.engine.scheduler import Scheduler
from workers.kv_connector.base import KvConnector, KvSent, TierStats
from workers.models.device_values import on_device
from workers.models.step import StepInput
from workers.runner.model_runner import ModelRunner
from workers.spec_decode.build import build_proposer
from workers.spec_decode.config import SpecConfig
from workers.spec_decode.proposer import DraftRequest
from workers.spec_decode.verify import Verdict, verify
from workers.structured.masks import apply_grammar_mask
from workers.structured.state import GrammarViolation

log = logging.getLogger(__name__)


class RequestRejected(Exception):
    """A request this engine can never serve as given; the message says why."""


class RequestFailed(Exception):
    """One request failed in a step its batch-mates survived (its sampling raised, or its logits were
    not finite); the message starts "the request failed on this worker: "."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the request failed on this worker: {reason}")


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


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    finished: bool
    finished_by_eos: bool
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass
class Sampled:
    """What one sampling request got from a step: its tokens, in order (the accepted drafts and the
    target's next pick, cut after a token that ends the request), and the drafts for its next step."""

    tokens: list[int]
    num_accepted: int  # drafts accepted by the target (even past a stop)
    drafts: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token, when asked for


@dataclass
class RequestHandle:
    """The caller's side of a request: tokens (or one exception) arrive on `outputs`; when the connector
    sends its KV, the transfer's outcome arrives on `kv_sent` (KvSent, or a KvTransferError)."""

    request: EngineRequest
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    compute_ms: float = 0.0
    kv_sent: Future[KvSent] | None = None


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
    tier: TierStats = TierStats()  # the shared KV tier's (all 0 without one)

    @property
    def waiting(self) -> int:
        return self.waiting_interactive + self.waiting_batch

    @property
    def kv_bytes_sent(self) -> int:
        return sum(self.kv_bytes_sent_by_path.values())

    @property
    def kv_bytes_received(self) -> int:
        return sum(self.kv_bytes_received_by_path.values())


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, stop: StopCriteria, executor: Executor) -> None:
        num_blocks = runner.num_blocks  # the runner's pool, sized by workers.main.build_engine
        self.runner = runner
        self.config = config
        self.connector: KvConnector | None = None  # KV that crosses workers: see attach_connector
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.token_budget, config.max_running)
        self._stop = stop
        self._executor = executor
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._load_watchers: set[asyncio.Event] = set()
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.steps_run = 0
        # called as on_step(tokens, milliseconds) after every step (metrics, benchmarks)
        self.on_step: Callable[[int, float], None] | None = None
        # called as on_logits(requests, logits) on the forward thread before sampling (benchmarks); a
        # request with drafts has one row per draft more
        self.on_logits: Callable[[list[EngineRequest], torch.Tensor], None] | None = None
        spec = config.speculative
        self.proposer = build_proposer(spec, runner.config.vocab_size, config.device) if spec else None
        self.draft_tokens_proposed = 0
        self.draft_tokens_accepted = 0

    def attach_connector(self, connector: KvConnector) -> None:
        """Gives the engine its KV connector (several composed: `workers.kv_connector.multi`), before its
        first request (the connector is built for the runner's KV layout and pool, which are known once the
        engine is)."""
        if self._handles or self.steps_run:
            raise RuntimeError("attach the KV connector before the engine takes its first request")
        self.connector = connector
        self.scheduler.connector = connector

    # ---- requests -------------------------------------------------------------------------------

    async def submit(self, request: EngineRequest) -> RequestHandle:
        """Queues a request once the connector prepared it (fetched the KV it may load); as `add`."""
        if self.connector is None:
            return self.add(request)
        await self.connector.prepare(request)
        try:
            handle = self.add(request)
        except BaseException:
            self.connector.discard(request)
            raise
        if request.request_id not in self._handles:  # failed at once: never queued
            self.connector.discard(request)
        return handle

    def add(self, request: EngineRequest) -> RequestHandle:
        """Queues a request. Raises RequestRejected when it can never be served as given (and the
        connector's KvTransferError when the KV it should load is not there)."""
        if request.request_id in self._handles:
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
        if self.connector is not None:
            handle.kv_sent = self.connector.add_request(request)
        self._handles[request.request_id] = handle
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
        """Stops a request; its blocks are freed before the next step."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.request.aborted = True
            self._wakeup.set()

    def stats(self) -> EngineStats:
        kv, scheduler = self.kv, self.scheduler
        transfers = self.connector.stats() if self.connector is not None else None
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
            kv_bytes_sent_by_path=transfers.sent_by_path if transfers else {},
            kv_bytes_received_by_path=transfers.received_by_path if transfers else {},
            draft_tokens_proposed=self.draft_tokens_proposed,
            draft_tokens_accepted=self.draft_tokens_accepted,
            tier=(transfers.tier if transfers else None) or TierStats(),
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
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._drop_aborted()
            out = self.scheduler.schedule()
            if not out.chunks:
                self._wakeup.clear()
                continue
            inputs = self._prepare(out)
            started = time.monotonic()
            try:
                results = await loop.run_in_executor(self._executor, self._step, out, inputs)
            except Exception as error:  # a failed step fails its requests, never the engine
                log.exception("engine step failed")
                self._connector_step_done(out)
                self._fail(out, error)
                continue
            self._connector_step_done(out)
            self.steps_run += 1
            self._account(out, (time.monotonic() - started) * 1000)
            if self.connector is not None:
                self.connector.before_update(out)
            self._update(out, results)
            if self.connector is not None:
                await self.connector.after_update(out)
            self._changed()

    def _prepare(self, out: SchedulerOutput) -> list[StepInput]:
        inputs = []
        for chunk in out.chunks:
            request, drafts = chunk.request, chunk.draft_token_ids
            tokens = request.all_token_ids[chunk.start : chunk.start + chunk.num_tokens - len(drafts)] + drafts
            block_ids = self.kv.block_ids(request.request_id)
            inputs.append(StepInput(tokens, chunk.start, block_ids, chunk.samples, len(drafts)))
        return inputs

    def _step(self, out: SchedulerOutput, inputs: list[StepInput]) -> list[Sampled | RequestFailed]:
        """Runs on the forward thread: the connector's loads, the model, the connector's saves, sampling
        (verifying drafts) and drafting for the next step; returns, per sampling request, its tokens or
        why it alone failed.
        Every tensor operation of the engine runs on this one thread: an operation on another thread
        would start a second OpenMP team whose spinning threads take cores from this one's."""
        connector, meta = self.connector, out.kv_connector_meta
        if connector is not None and meta is not None:
            connector.wait_for_save(meta)  # blocks freed since the last step may be overwritten now
            connector.load_kv(meta, self.runner)
        logits = self.runner.execute(inputs)
        if connector is not None and meta is not None:
            connector.save_kv(meta, self.runner)
        sampling = [chunk for chunk in out.chunks if chunk.samples]
        if self.on_logits is not None:
            self.on_logits([chunk.request for chunk in sampling], logits)
        rows = [(chunk.request, chunk.request.sample_index + j) for chunk in sampling for j in _positions(chunk)]
        picks, logprobs = _sample_each(logits, [request for request, _ in rows], [index for _, index in rows])
        results: list[Sampled | RequestFailed] = []
        first_row = 0
        for chunk in sampling:
            chunk_rows = slice(first_row, first_row + len(_positions(chunk)))
            first_row = chunk_rows.stop
            verdict = verify(chunk.draft_token_ids, picks[chunk_rows])
            if isinstance(verdict, RequestFailed):
                results.append(verdict)
                continue
            sampled = self._until_stop(chunk.request, verdict)
            # the distribution at position j picked token j (an accepted draft is the pick it equals)
            sampled.logprobs = logprobs[chunk_rows][: len(sampled.tokens)]
            results.append(sampled)
        self._propose(sampling, results)
        return results

    def _account(self, out: SchedulerOutput, step_ms: float) -> None:
        if self.on_step is not None:
            self.on_step(out.num_tokens, step_ms)
        for chunk in out.chunks:
            handle = self._handles.get(chunk.request.request_id)
            if handle is not None:
                handle.compute_ms += step_ms * chunk.num_tokens / out.num_tokens

    def _connector_step_done(self, out: SchedulerOutput) -> None:
        if self.connector is not None and out.kv_connector_meta is not None:
            self.connector.step_done(out.kv_connector_meta)

    def _until_stop(self, request: EngineRequest, verdict: Verdict) -> Sampled:
        """The verdict's tokens up to the first that ends the request: none after it is ever emitted."""
        for count, token_id in enumerate(verdict.tokens, 1):
            if request.prefill_only or self._finishes(request, token_id, request.sample_index + count)[0]:
                return Sampled(verdict.tokens[:count], verdict.num_accepted)
        return Sampled(verdict.tokens, verdict.num_accepted)

    def _propose(self, sampling: list[ScheduledChunk], results: list[Sampled | RequestFailed]) -> None:
        """Drafts, for every sampling request that decodes on, the tokens its next step verifies."""
        if self.proposer is None or self.config.speculative is None:
            return
        wanted = []
        for chunk, result in zip(sampling, results, strict=True):
            request = chunk.request
            if isinstance(result, RequestFailed) or request.prefill_only or not _draftable(request):
                continue
            if self._finishes(request, result.tokens[-1], request.sample_index + len(result.tokens))[0]:
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
        except Exception:  # noqa: BLE001 - drafts are optional: the requests decode on without them
            log.exception("the draft proposer raised; this step's requests decode their next token without drafts")
            return
        for (result, draft_request), drafts in zip(wanted, proposals, strict=True):
            result.drafts = drafts[: draft_request.max_drafts]

    def _update(self, out: SchedulerOutput, results: list[Sampled | RequestFailed]) -> None:
        sampling = [chunk for chunk in out.chunks if chunk.samples]
        by_chunk = {id(chunk): result for chunk, result in zip(sampling, results, strict=True)}
        for chunk in out.chunks:
            request, result = chunk.request, by_chunk.get(id(chunk))
            computed = chunk.num_tokens - len(chunk.draft_token_ids)
            if isinstance(result, Sampled):  # the accepted drafts' KV is the request's, up to a stop
                computed += min(len(result.tokens), result.num_accepted)
            request.num_computed_tokens += computed
            if request.num_computed_tokens <= len(request.prompt_token_ids):
                self.prompt_tokens_computed += computed
            if isinstance(result, RequestFailed):
                continue  # its fresh KV may hold the non-finite values that failed it: never share it
            token_ids = request.all_token_ids + (result.tokens if result is not None else [])
            self.kv.cache_full_blocks(request.request_id, token_ids, request.num_computed_tokens, request.cache_salt)
        for chunk, result in zip(sampling, results, strict=True):
            if isinstance(result, RequestFailed):
                self._fail_request(chunk.request, result)
                continue
            self.draft_tokens_proposed += len(chunk.draft_token_ids)
            self.draft_tokens_accepted += result.num_accepted
            chunk.request.draft_token_ids = result.drafts
            for token_id, logprobs in zip(result.tokens, result.logprobs, strict=True):
                self._emit(chunk.request, token_id, logprobs)

    def _finishes(self, request: EngineRequest, token_id: int, num_output_tokens: int) -> tuple[bool, bool]:
        """(finished, by end of sequence) when `token_id` becomes the request's output token number
        `num_output_tokens` (counted from 1 over the whole request, a migration's earlier tokens included)."""
        # max_tokens counts the request's tokens in all, those made before a migration included; they
        # are also part of this call's prompt, so the original prompt is what remains.
        prompt_length = len(request.prompt_token_ids) - request.sampling.tokens_already_generated
        return self._stop.check(token_id, num_output_tokens, prompt_length, request.sampling)

    def _emit(self, request: EngineRequest, token_id: int, logprobs: TokenLogprobs | None) -> None:
        request.output_token_ids.append(token_id)
        self.tokens_generated += 1
        finished, by_eos = self._finishes(request, token_id, request.sample_index)
        if request.constraint is not None:
            try:
                request.constraint.advance(token_id)
            except GrammarViolation as violation:
                self._fail_request(request, RequestFailed(str(violation)))
                return
            if request.constraint.complete:  # the grammar takes nothing more: the output is whole
                finished, by_eos = True, True
        handle = self._handles[request.request_id]
        handle.outputs.put_nowait(TokenOutput(token_id, finished, by_eos, logprobs))
        if finished or request.prefill_only:
            self._remove(request, FinishReason.STOPPED if finished else FinishReason.HANDED_OFF)

    def _drop_aborted(self) -> None:
        for handle in [h for h in self._handles.values() if h.request.aborted]:
            self._remove(handle.request, FinishReason.ABORTED)

    def _fail(self, out: SchedulerOutput, error: Exception) -> None:
        """The step as a whole failed (the forward pass raised): so do all its requests."""
        for request in {id(c.request): c.request for c in out.chunks}.values():
            self._fail_request(request, error)
        self._changed()

    def _fail_request(self, request: EngineRequest, error: Exception) -> None:
        if isinstance(error, RequestFailed):
            log.warning("request %s failed alone: %s", request.request_id, error)
        handle = self._handles.get(request.request_id)
        if handle is not None:
            handle.outputs.put_nowait(error)
        self._remove(request, FinishReason.FAILED)

    def _remove(self, request: EngineRequest, reason: FinishReason) -> None:
        if request.status is not RequestStatus.FINISHED:
            request.finish_reason = reason
            self.scheduler.finish(request)
        self._handles.pop(request.request_id, None)
        self._changed()

    def _changed(self) -> None:
        self._wakeup.set()
        for event in self._load_watchers:
            event.set()


_GREEDY = SamplingParams(temperature=0.0)


def _positions(chunk: ScheduledChunk) -> range:
    """The positions of a sampling chunk that get logits: its last token's, then each draft's."""
    return range(len(chunk.draft_token_ids) + 1)


def _draftable(request: EngineRequest) -> bool:
    """Whether speculative drafts may run ahead of the request: not when its logits change token by token
    (logit_bias, penalties counting each accepted draft) nor when it wants logprobs."""
    sampling = request.sampling
    return not (sampling.adjusts_logits or sampling.logprobs or request.constraint is not None)


def _controls_logits(request: EngineRequest) -> bool:
    """Whether the request's logits change before sampling (logit_bias, penalties, a grammar's mask)."""
    return request.sampling.adjusts_logits or request.constraint is not None


def _mask_by_grammar(row: torch.Tensor, request: EngineRequest) -> None:
    """The hook for structured outputs: masks, in place, the tokens the request's grammar forbids next;
    it runs after logit_bias and penalties, before temperature, top-k and top-p. No grammar: nothing."""
    if request.constraint is not None:
        apply_grammar_mask(row, request.constraint)


def _sample_each(
    logits, requests: list[EngineRequest], token_indices: list[int]
) -> tuple[list[int | RequestFailed], list[TokenLogprobs | None]]:
    """Samples every row of logits (row i: token `token_indices[i]` of `requests[i]`) after the request's
    own changes to its logits (`_controlled`); a row that is not finite, or whose changes or sampling
    raise, fails its request alone. Also each row's logprobs, where asked for. The rows stay on the
    logits' device until their picks and whether they were finite cross to the host in one copy.
    A request whose logits change has one row (it gets no drafts: `_draftable`)."""
    rows = list(range(len(requests)))
    finite = finite_rows(logits)  # before the changes: a grammar's mask is -inf by design
    logits, failed = _controlled(logits, requests, token_indices, rows)
    usable = [row for row in rows if row not in failed]
    picks = _sample_rows(logits, requests, token_indices, usable)
    if isinstance(picks, torch.Tensor):
        host = torch.cat([picks, finite.to(picks.dtype)]).tolist()
        results: list[int | RequestFailed] = list(host[: len(rows)])
        is_finite = host[len(rows) :]
    else:
        results, is_finite = list(picks), finite.tolist()
    for row, failure in failed.items():
        results[row] = failure
    for row, ok in enumerate(is_finite):
        if not ok:
            message = f"the model's logits for its output token {token_indices[row]} hold NaN or infinite values"
            results[row] = RequestFailed(message)
    logprobs: list[TokenLogprobs | None] = [None] * len(requests)
    wanting = [row for row in rows if requests[row].sampling.logprobs and not isinstance(results[row], RequestFailed)]
    if wanting:
        ids = on_device([results[row] for row in wanting], logits.device)
        tops = [requests[row].sampling.top_logprobs for row in wanting]
        wanted = logits[on_device(wanting, logits.device)]
        for row, entry in zip(wanting, token_logprobs(wanted, ids, tops), strict=True):
            logprobs[row] = entry
    return results, logprobs


def _controlled(
    logits, requests: list[EngineRequest], token_indices: list[int], rows: list[int]
) -> tuple[torch.Tensor, dict[int, RequestFailed]]:
    """The logits with the rows (of `rows`) whose request controls them changed, on a copy; the same
    tensor when none does, so a batch of plain requests pays nothing. Also the rows whose change raised:
    each fails its request alone."""
    failed: dict[int, RequestFailed] = {}
    changed = [row for row in rows if _controls_logits(requests[row])]
    if not changed:
        return logits, failed
    logits = logits.clone()
    for row in changed:
        request = requests[row]
        try:
            adjust_logits(logits[row], request.generated_token_ids, request.sampling)
            _mask_by_grammar(logits[row], request)
        except Exception as error:  # noqa: BLE001 - its own failure: logged, and the request fails alone
            log.exception("adjusting the logits of request %s raised", request.request_id)
            failed[row] = RequestFailed(f"adjusting its logits for output token {token_indices[row]} raised {error!r}")
    return logits, failed


def _sample_rows(
    logits, requests: list[EngineRequest], token_indices: list[int], rows: list[int]
) -> torch.Tensor | list[int | RequestFailed]:
    """The picks of all rows, on the logits' device (a row not in `rows` keeps its argmax: it failed
    already). One batched call; if it raises, row by row, so that only the rows that raise fail."""
    sampled = set(rows)
    params = [requests[row].sampling if row in sampled else _GREEDY for row in range(len(requests))]
    try:
        return draw(logits, params, token_indices)
    except Exception:  # noqa: BLE001 - the rows that raised are found, logged and failed one by one
        picks: list[int | RequestFailed] = [0] * len(requests)
        for row in rows:
            picks[row] = _sample_one(logits[row : row + 1], requests[row], token_indices[row])
        return picks


def _sample_one(logits, request: EngineRequest, token_index: int) -> int | RequestFailed:
    try:
        return sample(logits, [request.sampling], [token_index])[0]
    except Exception as error:
        log.exception("sampling request %s raised", request.request_id)
        return RequestFailed(f"sampling its output token {token_index} raised {error!r}")
