"""What a step hands back, and the update that follows it on the event loop: each request's tokens handed
out, its stop conditions and grammar checked, its KV bookkeeping done, and the requests that ended removed.

Per step (`OutputProcessor.update`), chunk by chunk: the tokens it computed (a prompt chunk's count as
prefill computed), the full blocks it filled named in the prefix cache, then each sampling request's
tokens emitted one at a time, each checked against the stop conditions and the request's grammar; the
request leaves at the first that ends it, and a request that failed leaves with its error.

With asynchronous scheduling the next step was scheduled, and runs, before this update (see
`workers.engine.core`). So a request that left after this step was scheduled (it finished in the step
before, was aborted, or failed) gets nothing from it: its token is discarded, never emitted nor counted
(tokens generated, prefill computed, compute time), and it names no block. A request preempted since
keeps its token (computed from its KV before the blocks were freed: it waits until this update ran) but
names nothing, as it holds no blocks.
"""

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from workers.engine.connector import KvSent
from workers.engine.request import EngineRequest, FinishReason, RequestFailed, RequestStatus
from workers.engine.sampling import StopCriteria, TokenLogprobs
from workers.engine.schedule import ScheduledChunk, SchedulerOutput
from workers.engine.scheduler import Scheduler
from workers.spec_decode.verify import Verdict
from workers.structured.state import GrammarViolation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    finished: bool
    finished_by_eos: bool
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass
class RequestHandle:
    """The caller's side of a request: tokens (or one exception) arrive on `outputs`; when the connector
    sends its KV, the transfer's outcome arrives on `kv_sent` (KvSent, or a KvTransferError)."""

    request: EngineRequest
    # TokenOutput, or the exception that ended the request (Any: bench.constrained_decoding reads .finished unchecked)
    outputs: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    compute_ms: float = 0.0
    kv_sent: Future[KvSent] | None = None


@dataclass
class Sampled:
    """What one sampling request got from a step: its tokens, in order (the accepted drafts and the
    target's next pick, cut after a token that ends the request), and the drafts for its next step."""

    tokens: list[int]
    num_accepted: int  # drafts accepted by the target (even past a stop)
    drafts: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token, when asked for


@dataclass(frozen=True)
class StepResult:
    """What the forward thread hands back for one step: per chunk, in order, what its request sampled (None:
    the chunk does not sample) or why it alone failed, and the step's time on the forward thread."""

    sampled: list[Sampled | RequestFailed | None]
    step_ms: float


def finishes(stop: StopCriteria, request: EngineRequest, token_id: int, num_output_tokens: int) -> tuple[bool, bool]:
    """(finished, by end of sequence) when `token_id` becomes the request's output token number
    `num_output_tokens` (counted from 1 over the whole request, a migration's earlier tokens included)."""
    # max_tokens counts the request's tokens in all, those made before a migration included; they
    # are also part of this call's prompt, so the original prompt is what remains.
    prompt_length = len(request.prompt_token_ids) - request.sampling.tokens_already_generated
    return stop.check(token_id, num_output_tokens, prompt_length, request.sampling)


def until_stop(stop: StopCriteria, request: EngineRequest, verdict: Verdict) -> Sampled:
    """The verdict's tokens up to the first that ends the request: none after it is ever emitted."""
    for count, token_id in enumerate(verdict.tokens, 1):
        if request.prefill_only or finishes(stop, request, token_id, request.sample_index + count)[0]:
            return Sampled(verdict.tokens[:count], verdict.num_accepted)
    return Sampled(verdict.tokens, verdict.num_accepted)


class OutputProcessor:
    """Holds the handles of the requests that have not left, and the counts of what the steps produced."""

    def __init__(self, scheduler: Scheduler, stop: StopCriteria, changed: Callable[[], None]) -> None:
        """`changed` is called whenever a request leaves (the engine's load watchers)."""
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.stop = stop
        self._changed = changed
        self.handles: dict[str, RequestHandle] = {}
        self.departed: list[EngineRequest] = []  # requests that left since the engine last took this list
        self._aborted: list[EngineRequest] = []  # aborted requests that have not left yet
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.draft_tokens_proposed = 0
        self.draft_tokens_accepted = 0

    def handle_of(self, request: EngineRequest) -> RequestHandle | None:
        """The request's handle while it has not left (its id may come back, as another request)."""
        handle = self.handles.get(request.request_id)
        return handle if handle is not None and handle.request is request else None

    def account(self, out: SchedulerOutput, step_ms: float) -> int:
        """Shares the step's time among its requests that are still here, by tokens; returns those tokens."""
        counted = [(chunk, handle) for chunk in out.chunks if (handle := self.handle_of(chunk.request)) is not None]
        tokens = sum(chunk.num_tokens for chunk, _ in counted)
        for chunk, handle in counted:
            handle.compute_ms += step_ms * chunk.num_tokens / tokens
        return tokens

    def update(self, out: SchedulerOutput, sampled: list[Sampled | RequestFailed | None]) -> None:
        """The step `out` ran and its requests sampled `sampled` (per chunk): see the module's docstring."""
        live = []
        for chunk, result in zip(out.chunks, sampled, strict=True):
            if result is not None:
                chunk.request.num_output_placeholders -= 1  # its token is on the host now, or discarded
            if self.handle_of(chunk.request) is not None and not chunk.request.aborted:
                live.append((chunk, result))
        for chunk, result in live:
            self._computed(chunk, result)
        for chunk, result in live:
            if isinstance(result, RequestFailed):
                self.fail_request(chunk.request, result)
            elif result is not None:
                self._emit_all(chunk, result)

    def _computed(self, chunk: ScheduledChunk, result: Sampled | RequestFailed | None) -> None:
        """Counts the chunk's computed tokens (`Scheduler.commit` counted all but its accepted drafts) and
        names the full blocks they filled."""
        request = chunk.request
        computed = chunk.num_tokens - len(chunk.draft_token_ids)
        running = request.status is RequestStatus.RUNNING  # not preempted since: it holds its blocks
        if isinstance(result, Sampled) and running:  # the accepted drafts' KV is the request's, up to a stop
            accepted = min(len(result.tokens), result.num_accepted)
            request.num_computed_tokens += accepted
            computed += accepted
        end = chunk.start + computed
        if end <= len(request.prompt_token_ids):
            self.prompt_tokens_computed += computed
        if isinstance(result, RequestFailed) or not running:
            return  # a failed request's fresh KV may hold the non-finite values that failed it: never share it
        if self.kv.fills_blocks(request.request_id, end):
            token_ids = request.all_token_ids + (result.tokens if result is not None else [])
            self.kv.cache_full_blocks(request.request_id, token_ids, end, request.cache_salt)

    def _emit_all(self, chunk: ScheduledChunk, result: Sampled) -> None:
        request = chunk.request
        self.draft_tokens_proposed += len(chunk.draft_token_ids)
        self.draft_tokens_accepted += result.num_accepted
        request.draft_token_ids = result.drafts
        for token_id, logprobs in zip(result.tokens, result.logprobs, strict=True):
            if request.status is RequestStatus.FINISHED:
                return  # its grammar refused the token before
            self._emit(request, token_id, logprobs)

    def _emit(self, request: EngineRequest, token_id: int, logprobs: TokenLogprobs | None) -> None:
        request.output_token_ids.append(token_id)
        self.tokens_generated += 1
        finished, by_eos = finishes(self.stop, request, token_id, request.sample_index)
        if request.constraint is not None:
            try:
                request.constraint.advance(token_id)
            except GrammarViolation as violation:
                self.fail_request(request, RequestFailed(str(violation)))
                return
            if request.constraint.complete:  # the grammar takes nothing more: the output is whole
                finished, by_eos = True, True
        handle = self.handles[request.request_id]
        handle.outputs.put_nowait(TokenOutput(token_id, finished, by_eos, logprobs))
        if finished or request.prefill_only:
            self.remove(request, FinishReason.STOPPED if finished else FinishReason.HANDED_OFF)

    def abort(self, request: EngineRequest) -> None:
        """The request gets nothing more; it leaves at the next `drop_aborted` that finds no step holding it."""
        request.aborted = True
        self._aborted.append(request)

    def drop_aborted(self, held: SchedulerOutput | None) -> None:
        """Removes the aborted requests, but those the step under way (`held`) computes for: they leave once
        it is done with them (the scheduler gives them nothing more)."""
        if not self._aborted:
            return
        holding = {id(chunk.request) for chunk in held.chunks} if held is not None else set()
        aborted, self._aborted = self._aborted, []
        for request in aborted:
            if id(request) in holding:
                self._aborted.append(request)
            elif self.handle_of(request) is not None:
                self.remove(request, FinishReason.ABORTED)

    def fail_step(self, out: SchedulerOutput, error: Exception) -> None:
        """The step as a whole failed (the forward pass raised): so do all its requests that are still here."""
        for request in {id(c.request): c.request for c in out.chunks if self.handle_of(c.request) is not None}.values():
            self.fail_request(request, error)

    def fail_request(self, request: EngineRequest, error: Exception) -> None:
        if isinstance(error, RequestFailed):
            log.warning("request %s failed alone: %s", request.request_id, error)
        handle = self.handle_of(request)
        if handle is not None:
            handle.outputs.put_nowait(error)
        self.remove(request, FinishReason.FAILED)

    def remove(self, request: EngineRequest, reason: FinishReason) -> None:
        """The request leaves: its blocks are freed (a step under way that still computes for it wrote them
        before any step scheduled from now on can reuse them: the forward thread runs steps in order)."""
        if request.status is not RequestStatus.FINISHED:
            request.finish_reason = reason
            self.scheduler.finish(request)
        if self.handle_of(request) is not None:
            del self.handles[request.request_id]
        self.departed.append(request)
        self._changed()
