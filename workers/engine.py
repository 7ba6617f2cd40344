"""The engine loop: schedule a step, run it on the model runner, sample, hand out tokens, repeat.

One engine serves every role. A prefill worker's requests are `prefill_only` (they stop after the first
token) and its KV connector streams their KV out as it is computed; a decode worker's connector loads
the KV its requests received; a colocated request runs both phases here, with no connector.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from workers.kv_cache_manager import KVCacheManager
from workers.kv_connector.base import KvConnector, KvSent
from workers.model_runner import ModelRunner, StepInput
from workers.request import BATCH, INTERACTIVE, EngineRequest, FinishReason, RequestStatus
from workers.sampling import StopCriteria, finite_rows, sample
from workers.scheduler import Scheduler, SchedulerOutput

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


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    finished: bool
    finished_by_eos: bool


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
    kv_bytes_sent: int
    kv_bytes_received: int

    @property
    def waiting(self) -> int:
        return self.waiting_interactive + self.waiting_batch


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
        # called as on_logits(requests, logits) on the forward thread before sampling (benchmarks)
        self.on_logits: Callable[[list[EngineRequest], torch.Tensor], None] | None = None

    def attach_connector(self, connector: KvConnector) -> None:
        """Gives the engine its KV connector, before its first request (the connector is built for the
        runner's KV layout and pool, which are known once the engine is)."""
        if self._handles or self.steps_run:
            raise RuntimeError("attach the KV connector before the engine takes its first request")
        self.connector = connector
        self.scheduler.connector = connector

    # ---- requests -------------------------------------------------------------------------------

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
        if (unknown := self._unknown_token(request)) is not None:
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
            kv_bytes_sent=transfers.bytes_sent if transfers else 0,
            kv_bytes_received=transfers.bytes_received if transfers else 0,
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
            self._update(out, results)
            self._changed()

    def _prepare(self, out: SchedulerOutput) -> list[StepInput]:
        inputs = []
        for chunk in out.chunks:
            request = chunk.request
            tokens = request.all_token_ids[chunk.start : chunk.start + chunk.num_tokens]
            inputs.append(StepInput(tokens, chunk.start, self.kv.block_ids(request.request_id), chunk.samples))
        return inputs

    def _step(self, out: SchedulerOutput, inputs: list[StepInput]) -> list[int | RequestFailed]:
        """Runs on the forward thread: the connector's loads, the model, the connector's saves, sampling;
        returns, per sampling request, its token or why it alone failed.
        Every tensor operation of the engine runs on this one thread: an operation on another thread
        would start a second OpenMP team whose spinning threads take cores from this one's."""
        connector, meta = self.connector, out.kv_connector_meta
        if connector is not None and meta is not None:
            connector.wait_for_save(meta)  # blocks freed since the last step may be overwritten now
            connector.load_kv(meta, self.runner)
        logits = self.runner.execute(inputs)
        if connector is not None and meta is not None:
            connector.save_kv(meta, self.runner)
        sampling = [chunk.request for chunk in out.chunks if chunk.samples]
        if self.on_logits is not None:
            self.on_logits(sampling, logits)
        return _sample_each(logits, sampling)

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

    def _update(self, out: SchedulerOutput, results: list[int | RequestFailed]) -> None:
        sampled = list(zip((chunk.request for chunk in out.chunks if chunk.samples), results, strict=True))
        failed = {id(request) for request, result in sampled if isinstance(result, RequestFailed)}
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if request.num_computed_tokens <= len(request.prompt_token_ids):
                self.prompt_tokens_computed += chunk.num_tokens
            if id(request) in failed:
                continue  # its fresh KV may hold the non-finite values that failed it: never share it
            self.kv.cache_full_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens, request.cache_salt
            )
        for request, result in sampled:
            if isinstance(result, RequestFailed):
                self._fail_request(request, result)
            else:
                self._emit(request, result)

    def _emit(self, request: EngineRequest, token_id: int) -> None:
        request.output_token_ids.append(token_id)
        self.tokens_generated += 1
        # max_tokens counts the request's tokens in all, those made before a migration included; they
        # are also part of this call's prompt, so the original prompt is what remains.
        already = request.sampling.tokens_already_generated
        finished, by_eos = self._stop.check(
            token_id, request.sample_index, len(request.prompt_token_ids) - already, request.sampling
        )
        handle = self._handles[request.request_id]
        handle.outputs.put_nowait(TokenOutput(token_id, finished, by_eos))
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


def _sample_each(logits, requests: list[EngineRequest]) -> list[int | RequestFailed]:
    """Samples every request whose row of logits is finite; a row that is not, or whose sampling
    raises, fails its request alone."""
    finite = finite_rows(logits)
    results: list[int | RequestFailed] = [
        RequestFailed(f"the model's logits for its output token {request.sample_index} hold NaN or infinite values")
        for request in requests
    ]
    usable = [row for row, ok in enumerate(finite) if ok]
    for row, result in zip(usable, _sample_rows(logits, requests, usable), strict=True):
        results[row] = result
    return results


def _sample_rows(logits, requests: list[EngineRequest], rows: list[int]) -> list[int | RequestFailed]:
    """One batched call; if it raises, row by row, so that only the rows that raise fail."""
    usable = logits if len(rows) == len(requests) else logits[rows]
    try:
        return list(sample(usable, [requests[r].sampling for r in rows], [requests[r].sample_index for r in rows]))
    except Exception:  # noqa: BLE001 - the rows that raised are found, logged and failed one by one
        return [_sample_one(logits[row : row + 1], requests[row]) for row in rows]


def _sample_one(logits, request: EngineRequest) -> int | RequestFailed:
    try:
        return sample(logits, [request.sampling], [request.sample_index])[0]
    except Exception as error:
        log.exception("sampling request %s raised", request.request_id)
        return RequestFailed(f"sampling its output token {request.sample_index} raised {error!r}")
