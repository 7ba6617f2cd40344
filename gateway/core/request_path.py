"""Runs a planned request on workers and yields every output token, the first one included, surviving
worker failures. Tokens come in lists, each of those that arrived together (one in the common case).

Split mode opens the decode call first (so the decode worker expects the KV cache and its one-time
transfer token), then the prefill call, which returns the first token and pushes the KV cache straight
to the decode worker; the KV cache never passes through here.

Failures: every read from a worker has a deadline. A prefill worker that fails before its KV cache
arrived is replaced and the prompt runs again elsewhere. A decode worker that fails mid-stream is
replaced too: prefill runs again on the prompt plus every token already produced, on another pair, and
the stream goes on from the next token, so the client sees no token twice and none missing (sampling
continues at the same token index, so seeded sampling gives the same tokens). Closing the generator
cancels the calls on both workers at once, which frees the KV cache on both.
"""

import asyncio
import dataclasses
import logging
import random
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial

import grpc
from opentelemetry.trace import Span, StatusCode

from diptych_common.logs import describe_error
from diptych_common.proto.v1 import worker_pb2
from diptych_common.tracing import start_span
from gateway.core.trace import PhaseRecord, RequestTrace, now, record_prefill, start_decode
from gateway.core.worker_calls import decode_request, generate_work, prefill_request, sampled, worker_sampling
from gateway.core.worker_failures import FailuresOf, WorkerFailure, ended_early
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import WorkerInfo
from gateway.fleet.token_streams import CallTokens, WorkerTokenStream
from gateway.metrics import (
    KV_TRANSFER_BYTES,
    KV_TRANSFER_SECONDS,
    MIGRATIONS,
    PREFIX_CACHE_MATCHED_TOKENS,
    RETRIES,
    ROUTING_DECISIONS,
    WORKER_BYTES_RECEIVED,
)
from gateway.routing.route import Decision, Route, RouteRequest
from gateway.routing.router import Lease, Router
from gateway.types import ErrorKind, GatewayError, GenerationPlan, SampledToken

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
MAX_REQUEST_FAULTS = 2  # workers that failed the request itself (INTERNAL) before it is given up
RETRY_BACKOFF_S = 0.05  # before the second attempt; doubled for each further one, with jitter
RETRY_BACKOFF_MAX_S = 1.0


@dataclasses.dataclass(frozen=True)
class Timeouts:
    first_token_s: float = 30.0  # a prefill call's first token (queueing included)
    kv_delivery_s: float = 30.0  # the KV hand-off, after the first token
    next_token_s: float = 10.0  # each following token of a stream


class RequestPath:
    def __init__(self, channels: Channels, board: LoadBoard, router: Router, timeouts: Timeouts = Timeouts()) -> None:
        self._channels = channels
        self._board = board
        self._router = router
        self._timeouts = timeouts

    async def run(self, plan: GenerationPlan, trace: RequestTrace) -> AsyncGenerator[list[SampledToken], None]:
        """The request's output tokens, in lists of those that arrived together; the last list ends with the
        request's last token. Close the iterator (contextlib.aclosing) to cancel the worker calls."""
        produced: list[int] = []
        avoid: set[str] = set()
        budget = plan.sampling.max_tokens
        while True:
            route = self._router.route(
                RouteRequest(
                    plan.model.name,
                    plan.prompt_token_ids + produced,
                    budget - len(produced),
                    frozenset(avoid),
                    plan.cache_salt,
                    trace.pin,
                    f"{plan.cache_salt}:{plan.prompt_cache_key}" if plan.prompt_cache_key else "",
                )
            )
            trace.decision = route.decision
            trace.attempts += 1
            ROUTING_DECISIONS.labels(plan.model.name, route.decision.value).inc()
            PREFIX_CACHE_MATCHED_TOKENS.inc(route.matched_tokens)
            lease = self._router.acquire(route)
            span = _attempt_span(trace, route, len(produced))
            try:
                if trace.attempts > 1:
                    await asyncio.sleep(_backoff(trace.attempts))
                async with aclosing(self._attempt(plan, route, produced, trace, lease, span)) as attempt:
                    async for tokens in attempt:
                        tokens = _within_budget(tokens, budget - len(produced))
                        produced.extend([token.token_id for token in tokens])
                        if tokens[-1].finished:  # before the yield: the caller may close us at the last token
                            self._router.note_finished(route, plan.prompt_token_ids + produced, plan.cache_salt)
                        yield tokens
                        if tokens[-1].finished:
                            return
                raise WorkerFailure(ended_early(route), (route.decode or route.prefill,), dead=False)
            except WorkerFailure as failure:
                span.set_status(StatusCode.ERROR, failure.error.message)
                if self._not_served(route, failure):
                    continue
                self._after_failure(plan, failure, produced, trace, avoid)
            finally:
                span.end()
                lease.release()

    def _attempt(
        self, plan: GenerationPlan, route: Route, produced: list[int], trace: RequestTrace, lease: Lease, span: Span
    ) -> AsyncGenerator[list[SampledToken], None]:
        """`span`: the attempt's, whose context the worker calls carry."""
        if route.decode is None:
            return self._colocated(plan, route, produced, trace, lease, span)
        return self._split(plan, route, route.decode, produced, trace, lease, span)

    def _not_served(self, route: Route, failure: WorkerFailure) -> bool:
        """A decode worker that does not serve Generate: go back to the split, without counting a failure."""
        not_served = failure.error.kind in (ErrorKind.UNIMPLEMENTED, ErrorKind.FAILED_PRECONDITION)
        if route.decision is Decision.SPLIT_SKIPPED and not_served and not failure.dead:
            self._router.note_no_generate(route.prefill.id)
            return True
        return False

    def _after_failure(
        self, plan: GenerationPlan, failure: WorkerFailure, produced: list[int], trace: RequestTrace, avoid: set[str]
    ) -> None:
        names = ", ".join(w.id for w in failure.culprits)
        trace.request_faults += failure.request_fault
        if trace.attempts >= MAX_ATTEMPTS or trace.request_faults >= MAX_REQUEST_FAULTS:
            log.warning("request %s failed on its last attempt (%s): %s", plan.request_id, names, failure)
            raise failure.error
        for worker in failure.culprits:
            avoid.add(worker.id)
            if failure.dead:
                self._board.mark_broken(worker.id)
        if produced:
            MIGRATIONS.inc()
            log.warning(
                "request %s: moving the stream after %d tokens away from %s: %s",
                plan.request_id,
                len(produced),
                names,
                failure,
            )
        else:
            RETRIES.labels("prefill").inc()
            log.warning("request %s: retrying the prompt away from %s: %s", plan.request_id, names, failure)

    async def _split(
        self,
        plan: GenerationPlan,
        route: Route,
        decode: WorkerInfo,
        produced: list[int],
        trace: RequestTrace,
        lease: Lease,
        span: Span,
    ) -> AsyncGenerator[list[SampledToken], None]:
        prompt = plan.prompt_token_ids + produced
        metadata = self._channels.metadata(span)
        sampling = worker_sampling(plan.sampling, produced)
        transfer_token = secrets.token_bytes(32)
        attempt_id = trace.attempt_id(plan.request_id)
        stream = await self._token_stream(decode, "decode")
        decode_call = self._channels.stub(decode.address).Decode(
            decode_request(plan, attempt_id, prompt, sampling, transfer_token, stream),
            timeout=self.call_deadline(plan.sampling.max_tokens - len(produced)),
            metadata=metadata,
        )
        decode_tokens = CallTokens(decode_call, stream, attempt_id)
        prefill_call = self._channels.stub(route.prefill.address).Prefill(
            prefill_request(plan, attempt_id, prompt, sampling, transfer_token, decode.address),
            timeout=self._timeouts.first_token_s + self._timeouts.kv_delivery_s,
            metadata=metadata,
        )
        kv_task = None
        started = now()
        try:
            message = await self._read(prefill_call, route.prefill, "prefill", self._timeouts.first_token_s)
            first = message.first_token
            lease.release(route.prefill.id)  # the prompt is done: it no longer weighs on the prefill worker
            prefill_record = record_prefill(trace, route.prefill, started, first.compute_ms, first.cached_tokens)
            if first.finished:
                trace.prompt_shared.set()
            yield [sampled(first)]
            if first.finished:
                return
            decode_record = start_decode(trace, decode)
            kv_task = asyncio.create_task(self._kv_delivered(prefill_call, route.prefill, decode))
            kv_task.add_done_callback(partial(_fail_on_lost_kv, decode_tokens))
            while True:
                events = await self._next_events(decode_tokens, route, decode, "decode", self._timeouts.next_token_s)
                trace.prompt_shared.set()  # a decode token: the decode worker admitted the prompt's blocks
                last = events[-1]
                if last.finished:
                    decode_record.compute_ms += last.stats.compute_ms
                    await self._account_kv(kv_task, prefill_record, decode_record)
                yield [sampled(event) for event in events]
                if last.finished:
                    return
        finally:
            if kv_task is not None:
                kv_task.cancel()
                if kv_task.done() and not kv_task.cancelled():
                    kv_task.exception()  # retrieved: a failed hand-off was already handled or moot
            decode_tokens.close()
            prefill_call.cancel()

    async def _next_events(
        self, tokens: CallTokens, route: Route, worker: WorkerInfo, phase: str, timeout_s: float
    ) -> list[worker_pb2.TokenEvent]:
        """The token events that came from `worker` since the last read, up to the call's last (waiting up
        to `timeout_s` for one). Fails when none came in time, the call or its stream failed, or the KV
        hand-off failed before them (`_fail_on_lost_kv`)."""
        with FailuresOf(worker, phase):
            events = await tokens.read_ready(timeout_s)
        if not isinstance(events, list):  # EOF: the stream that carries them ended
            raise WorkerFailure(ended_early(route), (worker,), dead=False)
        for index, event in enumerate(events):
            if event.finished:
                return events[: index + 1]
        return events

    async def _kv_delivered(
        self,
        prefill_call: grpc.aio.UnaryStreamCall[worker_pb2.PrefillRequest, worker_pb2.PrefillEvent],
        prefill: WorkerInfo,
        decode: WorkerInfo,
    ) -> worker_pb2.KvDelivered:
        """The prefill worker's report that the KV cache arrived. When the hand-off fails either side may
        be at fault (a dead decode worker makes the push fail): the request moves to another pair."""
        try:
            message = await self._read(prefill_call, prefill, "prefill", self._timeouts.kv_delivery_s)
        except WorkerFailure as failure:
            raise WorkerFailure(failure.error, (prefill, decode), dead=False) from None
        if not message.HasField("kv_delivered"):
            raise WorkerFailure(
                GatewayError(ErrorKind.UNAVAILABLE, f"the prefill worker {prefill.id} sent no KV delivery"),
                (prefill, decode),
                dead=False,
            )
        delivered = message.kv_delivered
        KV_TRANSFER_BYTES.inc(delivered.kv_bytes)
        KV_TRANSFER_SECONDS.observe(delivered.transfer_ms / 1000)
        return delivered

    async def _account_kv(
        self, kv_task: asyncio.Task[worker_pb2.KvDelivered], prefill: PhaseRecord, decode: PhaseRecord
    ) -> None:
        """Every token is in: the KV cache arrived, so its delivery report only adds to usage."""
        try:
            delivered = await asyncio.wait_for(asyncio.shield(kv_task), self._timeouts.kv_delivery_s)
        except (WorkerFailure, TimeoutError) as error:
            log.warning("no KV delivery report after the stream ended: %s", describe_error(error))
            return
        prefill.kv_bytes += delivered.kv_bytes
        decode.kv_bytes += delivered.kv_bytes

    async def _colocated(
        self, plan: GenerationPlan, route: Route, produced: list[int], trace: RequestTrace, lease: Lease, span: Span
    ) -> AsyncGenerator[list[SampledToken], None]:
        phase = "colocated" if route.decision is Decision.COLOCATED else "decode"
        stream = await self._token_stream(route.prefill, phase)
        attempt_id = trace.attempt_id(plan.request_id)
        call = self._channels.stub(route.prefill.address).Generate(
            generate_work(plan, attempt_id, produced, stream),
            timeout=self.call_deadline(plan.sampling.max_tokens - len(produced)),
            metadata=self._channels.metadata(span),
        )
        tokens = CallTokens(call, stream, attempt_id)
        started = now()
        try:
            events = await self._next_events(tokens, route, route.prefill, phase, self._timeouts.first_token_s)
            first = events[0]
            lease.prompt_done()
            record_prefill(trace, route.prefill, started, first.stats.compute_ms, first.stats.cached_tokens)
            decode_record = start_decode(trace, route.prefill)
            trace.prompt_shared.set()
            while True:
                last = events[-1]
                if last.finished and last is not first:
                    decode_record.compute_ms += last.stats.compute_ms
                yield [sampled(event) for event in events]
                if last.finished:
                    return
                events = await self._next_events(tokens, route, route.prefill, phase, self._timeouts.next_token_s)
        finally:
            tokens.close()

    async def _token_stream(self, worker: WorkerInfo, phase: str) -> WorkerTokenStream | None:
        """The worker's token stream for the call about to go to it (None: the call carries its tokens)."""
        try:
            with FailuresOf(worker, phase):
                return await self._channels.token_stream(worker.address, self._timeouts.first_token_s)
        except ConnectionError as error:
            unavailable = GatewayError(ErrorKind.UNAVAILABLE, f"the {phase} worker {worker.id}: {error}")
            raise WorkerFailure(unavailable, (worker,), dead=False) from None

    async def _read(
        self,
        call: grpc.aio.UnaryStreamCall[worker_pb2.PrefillRequest, worker_pb2.PrefillEvent],
        worker: WorkerInfo,
        phase: str,
        timeout: float,
    ) -> worker_pb2.PrefillEvent:
        with FailuresOf(worker, phase):
            async with asyncio.timeout(timeout):  # no task per message, as wait_for would make
                message = await call.read()
        if not isinstance(message, worker_pb2.PrefillEvent):  # grpc.aio.EOF
            raise WorkerFailure(
                GatewayError(ErrorKind.UNAVAILABLE, f"the {phase} worker {worker.id} ended its stream early"),
                (worker,),
                dead=False,
            )
        WORKER_BYTES_RECEIVED.inc(message.ByteSize())
        return message

    def call_deadline(self, max_tokens: int) -> float:
        """The longest a request with `max_tokens` to produce may take on workers."""
        t = self._timeouts
        return t.first_token_s + t.kv_delivery_s + max_tokens * t.next_token_s


def _attempt_span(trace: RequestTrace, route: Route, produced: int) -> Span:
    attributes = {"attempt": trace.attempts, "decision": route.decision.value, "prefill.worker": route.prefill.id}
    if route.decode is not None:
        attributes["decode.worker"] = route.decode.id
    if produced:
        attributes["tokens_already_sent"] = produced  # a migrated stream: prefill re-runs on prompt + these
    return start_span("gateway.attempt", trace.span, attributes=attributes)


def _backoff(attempt: int) -> float:
    """Seconds to wait before `attempt` (2, 3, ...): exponential, with full jitter so retries spread out."""
    return random.uniform(0, min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2 ** (attempt - 2)))


def _within_budget(tokens: list[SampledToken], room: int) -> list[SampledToken]:
    """`tokens` up to the one that uses the request's last `room` tokens, which ends it (a worker that
    counts the budget per call may not say so)."""
    if len(tokens) < room:
        return tokens
    last = tokens[room - 1]
    if not last.finished:
        last = dataclasses.replace(last, finished=True, finished_by_eos=False)
    return [*tokens[: room - 1], last]


def _fail_on_lost_kv(decode_tokens: CallTokens, kv_task: asyncio.Task[worker_pb2.KvDelivered]) -> None:
    """A KV hand-off that failed fails the decode call's reader, after the tokens that came before it."""
    error = None if kv_task.cancelled() else kv_task.exception()
    if error is not None:
        decode_tokens.fail(error)
