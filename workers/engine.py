"""The engine loop: schedule a step, run it on the model runner, sample, hand out tokens, repeat.

One engine serves every role. A prefill worker's requests are `prefill_only` (they stop after the first
token, their KV is staged for transfer as it is computed); a decode worker's requests start from
imported KV; a colocated request runs both phases here.
"""

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from workers.kv_cache_manager import KVCacheManager
from workers.model_runner import ModelRunner, StepInput
from workers.request import BATCH, INTERACTIVE, EngineRequest, RequestStatus
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
    num_kv_blocks: int = 0          # 0: as many as kv_cache_mib holds
    kv_cache_mib: int = 256
    token_budget: int = 512         # tokens per step, prompt chunks and decoding tokens together
    max_running: int = 64
    enable_prefix_caching: bool = True
    device: str = "cpu"
    cuda_graphs: bool = True        # on CUDA devices, replay decode steps from captured graphs


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    finished: bool
    finished_by_eos: bool


@dataclass
class RequestHandle:
    """The caller's side of a request: tokens (or one exception) arrive on `outputs`."""

    request: EngineRequest
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    compute_ms: float = 0.0


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, stop: StopCriteria, executor: Executor) -> None:
        num_blocks = runner.num_blocks  # the runner's pool, sized by workers.main.build_engine
        self.runner = runner
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.token_budget, config.max_running)
        self._stop = stop
        self._executor = executor
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._load_watchers: set[asyncio.Event] = set()
        self._leaving_stages: list = []  # KV stages of requests that left since the last step
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.steps_run = 0
        self.on_step = None  # called as on_step(tokens, milliseconds) after every step (metrics, benchmarks)
        # called as on_logits(requests, logits) on the forward thread before sampling (benchmarks)
        self.on_logits = None

    # ---- requests -------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> RequestHandle:
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

    @property
    def num_active(self) -> int:
        return len(self.scheduler.running)

    def waiting(self, priority: int) -> int:
        return self.scheduler.waiting_count(priority)

    @property
    def num_waiting(self) -> int:
        return self.waiting(INTERACTIVE) + self.waiting(BATCH)

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
            inputs, staging = self._prepare(out)
            self._leaving_stages += [r.kv_stage for r in out.preempted if r.kv_stage is not None]
            leaving, self._leaving_stages = self._leaving_stages, []
            started = time.monotonic()
            try:
                results = await loop.run_in_executor(self._executor, self._step, out, inputs, staging, leaving)
            except Exception as error:  # a failed step fails its requests, never the engine
                log.exception("engine step failed")
                self._fail(out, error)
                continue
            self.steps_run += 1
            self._account(out, (time.monotonic() - started) * 1000)
            self._update(out, results)
            self._changed()

    def _prepare(self, out: SchedulerOutput) -> tuple[list[StepInput], list[tuple]]:
        inputs, staging = [], []
        for chunk in out.chunks:
            request = chunk.request
            block_ids = self.kv.block_ids(request.request_id)
            tokens = request.all_token_ids[chunk.start:chunk.start + chunk.num_tokens]
            inputs.append(StepInput(tokens, chunk.start, block_ids, chunk.samples))
            stage = request.kv_stage
            if stage is not None:
                computed = chunk.start + chunk.num_tokens
                prompt_done = computed >= len(request.prompt_token_ids)
                upto = self.kv.blocks_for(computed) if prompt_done else computed // self.kv.block_size
                if upto > stage.blocks_staged:
                    staging.append((stage, block_ids[stage.blocks_staged:upto], stage.blocks_staged))
                    stage.blocks_staged = upto
        return inputs, staging

    def _step(
        self, out: SchedulerOutput, inputs: list[StepInput], staging: list[tuple], leaving: list
    ) -> list[int | RequestFailed]:
        """Runs on the forward thread: writes imported KV, runs the model, samples, stages KV for transfer;
        returns, per sampling request, its token or why it alone failed.
        Blocks freed by requests that left may be overwritten now: their transfers must have read them.
        Every tensor operation of the engine runs on this one thread: an operation on another thread
        would start a second OpenMP team whose spinning threads take cores from this one's."""
        for stage in leaving:
            stage.wait_sent()
        for request in out.imports:
            block_ids = self.kv.block_ids(request.request_id)
            for first_block, data in request.imported_kv.chunks:
                self.runner.write_blocks(block_ids[first_block:first_block + data.shape[2]], data)
        logits = self.runner.execute(inputs)
        for stage, block_ids, first_block in staging:
            stage.write_blocks(self.runner, block_ids, first_block)
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

    def _update(self, out: SchedulerOutput, results: list[int | RequestFailed]) -> None:
        for request in out.imports:
            request.imported_kv, imported = None, request.imported_kv
            if imported.release is not None:
                imported.release()
        sampled = list(zip((chunk.request for chunk in out.chunks if chunk.samples), results))
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
            self._remove(request)

    def _drop_aborted(self) -> None:
        for handle in [h for h in self._handles.values() if h.request.aborted]:
            self._remove(handle.request)

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
        self._remove(request)

    def _remove(self, request: EngineRequest) -> None:
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.finish(request)
            if request.kv_stage is not None:
                self._leaving_stages.append(request.kv_stage)
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
        RequestFailed(
            f"the model's logits for its output token {request.sample_index} hold NaN or infinite values"
        )
        for request in requests
    ]
    usable = [row for row, ok in enumerate(finite) if ok]
    for row, result in zip(usable, _sample_rows(logits, requests, usable)):
        results[row] = result
    return results


def _sample_rows(logits, requests: list[EngineRequest], rows: list[int]) -> list[int | RequestFailed]:
    """One batched call; if it raises, row by row, so that only the rows that raise fail."""
    usable = logits if len(rows) == len(requests) else logits[rows]
    try:
        return sample(usable, [requests[r].sampling for r in rows], [requests[r].sample_index for r in rows])
    except Exception:  # noqa: BLE001 - the rows that raised are found, logged and failed one by one
        return [_sample_one(logits[row:row + 1], requests[row]) for row in rows]


def _sample_one(logits, request: EngineRequest) -> int | RequestFailed:
    try:
        return sample(logits, [request.sampling], [request.sample_index])[0]
    except Exception as error:
        log.exception("sampling request %s raised", request.request_id)
        return RequestFailed(f"sampling its output token {request.sample_index} raised {error!r}")
