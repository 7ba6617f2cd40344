"""The worker's gRPC service. Prefill workers serve Prefill; decode workers serve Decode, Generate and
GetKvEndpoint; colocated workers serve Generate. Every role serves GetLoad and WatchLoad.

A prefill worker's engine carries a `PrefillConnector` (it sends each request's KV to the decode worker
its call names), a decode worker's a `DecodeConnector` (it receives and loads KV); this service only
hands each request its part in the hand-off (`KvTransferParams`) and reports the outcome."""

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.trace import Span, SpanKind
from typing_extensions import override

from diptych_common.grammar import JSON_OBJECT, JSON_SCHEMA, LARK_GRAMMAR, Grammar
from diptych_common.logs import bind_request, describe_error
from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_common.tracing import (
    context_from_metadata,
    context_from_traceparent,
    ending,
    now_ns,
    record_span,
    start_span,
    trace_id_of,
    traceparent_of,
)
from diptych_common.worker_credential import WorkerSecret
from workers.engine.connector import KvSent
from workers.engine.core import Engine, RequestFailed, RequestHandle, RequestRejected, TokenOutput
from workers.engine.kv_transfer import KvTransferParams, Peer
from workers.engine.request import BATCH, INTERACTIVE, EngineRequest
from workers.engine.sampling import SamplingParams, TokenLogprobs
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.multi import parts_of
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import ReceivedKv
from workers.kv_connector.wire import KvTransferError
from workers.serving.load import RateMeter, WorkerLoad
from workers.serving.token_streams import TokenStream, TokenStreamClosed, TokenStreams
from workers.structured.compiler import GrammarCompiler, GrammarRejected

log = logging.getLogger(__name__)

LOAD_MIN_INTERVAL_S = 0.05
LOAD_MAX_INTERVAL_S = 1.0
MAX_TOP_LOGPROBS = 20


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass
class WorkerState:
    role: Role
    worker_id: str = ""
    draining: bool = False


def sampling_from_proto(message: worker_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        seed=message.seed if message.has_seed else None,
        max_tokens=message.max_tokens,
        ignore_eos=message.ignore_eos,
        tokens_already_generated=message.tokens_already_generated,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        logprobs=message.logprobs,
        top_logprobs=min(message.top_logprobs, MAX_TOP_LOGPROBS),
    )


def logprobs_to_proto(logprobs: TokenLogprobs | None) -> worker_pb2.TokenLogprobs | None:
    if logprobs is None:
        return None
    return worker_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top=[worker_pb2.TopLogprob(token_id=token_id, logprob=value) for token_id, value in logprobs.top],
    )


def grammar_from_proto(message: worker_pb2.SamplingParams) -> Grammar | None:
    if not message.HasField("constraint"):
        return None
    kind = message.constraint.WhichOneof("grammar")
    if kind == JSON_OBJECT:
        return Grammar(JSON_OBJECT)
    if kind in (JSON_SCHEMA, LARK_GRAMMAR):
        return Grammar(kind, getattr(message.constraint, kind))
    return None


def _token_event(output: TokenOutput, stats: worker_pb2.PhaseStats | None) -> worker_pb2.TokenEvent:
    return worker_pb2.TokenEvent(
        token_id=output.token_id,
        finished=output.finished,
        finished_by_eos=output.finished_by_eos,
        stats=stats,
        logprobs=logprobs_to_proto(output.logprobs),
    )


def _priority(value: int) -> int:
    return BATCH if value == worker_pb2.PRIORITY_BATCH else INTERACTIVE


# The one place a role names its KV hand-off connector: workers.serving.kv_hand_off builds it, and a
# service checks the engine it serves against it.
HAND_OFF_OF_ROLE: dict[Role, type[PrefillConnector] | type[DecodeConnector] | None] = {
    Role.PREFILL: PrefillConnector,
    Role.DECODE: DecodeConnector,
    Role.COLOCATED: None,
}


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        state: WorkerState,
        engine: Engine,
        secret: WorkerSecret | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        parts = parts_of(engine.connector)
        hand_offs = [part for part in parts if isinstance(part, PrefillConnector | DecodeConnector)]
        connector = hand_offs[0] if len(hand_offs) == 1 else None
        wanted = HAND_OFF_OF_ROLE[state.role]
        if len(hand_offs) > 1 or not isinstance(connector, wanted or type(None)):
            raise ValueError(
                f"a {state.role} worker's engine takes {wanted.__name__ if wanted else 'none'} as its KV hand-off "
                "connector, "
                f"not {' and '.join(type(part).__name__ for part in hand_offs) or 'none'}"
            )
        self._sender = connector if isinstance(connector, PrefillConnector) else None
        self._receiver = connector if isinstance(connector, DecodeConnector) else None
        self._state = state
        self._secret = secret or WorkerSecret()
        self._engine = engine
        self._rate = RateMeter()
        self._grammars = grammars  # structured outputs: None refuses requests with a grammar
        self.token_streams = TokenStreams()

    # ---- serving ------------------------------------------------------------------------------

    async def Prefill(
        self,
        request: worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext[worker_pb2.PrefillRequest, worker_pb2.PrefillEvent],
    ) -> AsyncIterator[worker_pb2.PrefillEvent]:
        span = _call_span("worker.prefill", request.request_id, context)
        with ending(span), _logged_call("prefill", len(request.prompt_token_ids)):
            transfer = start_span("kv.transfer", span, kind=SpanKind.PRODUCER)
            with ending(transfer):
                async for event in self._prefill(request, context, span, transfer):
                    yield event

    async def _prefill(
        self,
        request: worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext[worker_pb2.PrefillRequest, worker_pb2.PrefillEvent],
        span: Span,
        transfer: Span,
    ) -> AsyncIterator[worker_pb2.PrefillEvent]:
        """`transfer`: the kv.transfer span, whose context the KV hello carries to the decode worker."""
        await self._admit(context, Role.PREFILL)
        peer = await self._peer(request.decode_address, context)
        engine_request = EngineRequest(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_from_proto(request.sampling),
            _priority(request.priority),
            prefill_only=True,
            cache_salt=request.cache_salt,
            kv_transfer=KvTransferParams(
                send_to=peer, transfer_token=request.transfer_token, traceparent=traceparent_of(transfer)
            ),
        )
        await self._constrain(engine_request, request.sampling, context)
        handle = await self._add(engine_request, context)
        first = await anext(self._outputs(handle, context))
        _record_queue_and_compute(engine_request, "prefill.compute", span, now_ns())
        started = time.monotonic()
        yield worker_pb2.PrefillEvent(
            first_token=worker_pb2.FirstToken(
                token_id=first.token_id,
                cached_tokens=engine_request.num_cached_tokens,
                compute_ms=round(handle.compute_ms),
                finished=first.finished,
                finished_by_eos=first.finished_by_eos,
                logprobs=logprobs_to_proto(first.logprobs),
            )
        )
        sent = _awaitable(handle.kv_sent)
        if first.finished:  # the connector stopped the transfer: no KV follows
            await asyncio.gather(sent, return_exceptions=True)
            yield worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KvDelivered())
            return
        try:
            delivered = await sent
        except KvTransferError as error:
            assert self._sender is not None  # a prefill worker's (checked when the service was made)
            self._sender.forget_peer(request.decode_address)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not deliver the KV cache to the decode worker at {request.decode_address}: "
                f"{error.code.name}: {error}",
            )
        transfer.set_attributes({"kv_bytes": delivered.nbytes, "data_path": delivered.data_path})
        yield worker_pb2.PrefillEvent(
            kv_delivered=worker_pb2.KvDelivered(
                kv_bytes=delivered.nbytes,
                transfer_ms=round((time.monotonic() - started) * 1000),
                data_path=delivered.data_path,
            )
        )

    async def Decode(
        self,
        request: worker_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DecodeRequest, worker_pb2.TokenEvent],
    ) -> AsyncIterator[worker_pb2.TokenEvent]:
        span = _call_span("worker.decode", request.request_id, context)
        with ending(span), _logged_call("decode"):
            async for event in self._decode(request, context, span):
                yield event

    async def _decode(
        self,
        request: worker_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DecodeRequest, worker_pb2.TokenEvent],
        span: Span,
    ) -> AsyncIterator[worker_pb2.TokenEvent]:
        await self._admit(context, Role.DECODE)
        received = await self._await_kv(request, context)
        _record_receive(received, span)
        try:
            engine_request = EngineRequest(
                request.request_id,
                received.prompt_token_ids,
                sampling_from_proto(request.sampling),
                _priority(request.priority),
                output_token_ids=[received.first_token_id],
                cache_salt=request.cache_salt,
                kv_transfer=KvTransferParams(load_tokens=received.num_tokens),
            )
            await self._constrain(engine_request, request.sampling, context)
            stream = await self._token_stream(request.token_stream, context)
            handle = await self._add(engine_request, context)
        finally:
            assert self._receiver is not None  # a decode worker's (checked when the service was made)
            self._receiver.forget(request.request_id)  # what the engine did not take goes back
        try:
            async for output in self._outputs(handle, context):
                stats = worker_pb2.PhaseStats(compute_ms=round(handle.compute_ms)) if output.finished else None
                event = _token_event(output, stats)
                if stream is None:
                    yield event
                else:
                    await self._put(stream, request.request_id, event, context)
        finally:
            _record_queue_and_compute(engine_request, "decode.compute", span, now_ns())

    async def Generate(
        self,
        request: worker_pb2.GenerateWork,
        context: grpc.aio.ServicerContext[worker_pb2.GenerateWork, worker_pb2.TokenEvent],
    ) -> AsyncIterator[worker_pb2.TokenEvent]:
        span = _call_span("worker.generate", request.request_id, context)
        with ending(span), _logged_call("generate", len(request.prompt_token_ids)):
            async for event in self._generate(request, context, span):
                yield event

    async def _generate(
        self,
        request: worker_pb2.GenerateWork,
        context: grpc.aio.ServicerContext[worker_pb2.GenerateWork, worker_pb2.TokenEvent],
        span: Span,
    ) -> AsyncIterator[worker_pb2.TokenEvent]:
        await self._admit(context, Role.COLOCATED, Role.DECODE)
        engine_request = EngineRequest(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_from_proto(request.sampling),
            _priority(request.priority),
            cache_salt=request.cache_salt,
        )
        await self._constrain(engine_request, request.sampling, context)
        stream = await self._token_stream(request.token_stream, context)
        handle = await self._add(engine_request, context)
        first_ns = 0
        try:
            async for output in self._outputs(handle, context):
                stats = None
                if not first_ns or output.finished:
                    stats = worker_pb2.PhaseStats(
                        compute_ms=round(handle.compute_ms), cached_tokens=engine_request.num_cached_tokens
                    )
                if not first_ns:
                    first_ns = now_ns()
                    _record_queue_and_compute(engine_request, "prefill.compute", span, first_ns)
                event = _token_event(output, stats)
                if stream is None:
                    yield event
                else:
                    await self._put(stream, request.request_id, event, context)
        finally:
            if first_ns:
                record_span("decode.compute", span, first_ns, now_ns())

    async def StreamTokens(
        self,
        request: worker_pb2.TokenStreamRequest,
        context: grpc.aio.ServicerContext[worker_pb2.TokenStreamRequest, worker_pb2.TokenBatch],
    ) -> AsyncIterator[worker_pb2.TokenBatch]:
        await self._require_role(context, Role.COLOCATED, Role.DECODE)
        if not request.stream_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TokenStreamRequest.stream_id is empty")
        stream = self.token_streams.open(request.stream_id)
        if stream is None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "a token stream with this id is open already")
            return
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            self.token_streams.close(request.stream_id, stream)

    async def _token_stream(self, stream_id: str, context: grpc.aio.ServicerContext[Any, Any]) -> TokenStream | None:
        """The open token stream a call names; None when it names none (its tokens go on its own stream)."""
        if not stream_id:
            return None
        stream = self.token_streams.get(stream_id)
        if stream is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the call names a token stream that is not open on this worker: open it with StreamTokens first",
            )
        return stream

    async def _put(
        self,
        stream: TokenStream,
        request_id: str,
        event: worker_pb2.TokenEvent,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        try:
            stream.put(request_id, event)
        except TokenStreamClosed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the token stream this call names was closed")

    async def GetKvEndpoint(
        self,
        request: worker_pb2.KvEndpointRequest,
        context: grpc.aio.ServicerContext[worker_pb2.KvEndpointRequest, worker_pb2.KvEndpoint],
    ) -> worker_pb2.KvEndpoint:
        await self._require_role(context, Role.DECODE)
        assert self._receiver is not None  # a decode worker's (checked when the service was made)
        endpoint = worker_pb2.KvEndpoint(**dataclasses.asdict(self._receiver.endpoint()))
        endpoint.proof = self._secret.endpoint_proof(request.challenge, endpoint)
        return endpoint

    # ---- load ---------------------------------------------------------------------------------

    @override
    async def GetLoad(
        self,
        request: worker_pb2.LoadRequest,
        context: grpc.aio.ServicerContext[worker_pb2.LoadRequest, worker_pb2.Load],
    ) -> worker_pb2.Load:
        return self.load().to_proto()

    @override
    async def WatchLoad(
        self,
        request: worker_pb2.LoadRequest,
        context: grpc.aio.ServicerContext[worker_pb2.LoadRequest, worker_pb2.Load],
    ) -> AsyncIterator[worker_pb2.Load]:
        changed = self._engine.watch_load()
        try:
            last_key, last_sent = None, 0.0
            while True:
                load = self.load().to_proto()
                key = _without_rate(load)
                now = time.monotonic()
                if key != last_key or now - last_sent >= LOAD_MAX_INTERVAL_S:
                    yield load
                    last_key, last_sent = key, now
                changed.clear()
                await asyncio.sleep(LOAD_MIN_INTERVAL_S)
                until_due = max(0.0, LOAD_MAX_INTERVAL_S - (time.monotonic() - last_sent))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), until_due)
        finally:
            self._engine.unwatch_load(changed)

    def load(self) -> WorkerLoad:
        stats = self._engine.stats()
        done = stats.prompt_tokens_computed if self._state.role is Role.PREFILL else stats.tokens_generated
        return WorkerLoad(self._state.worker_id, self._state.draining, self._rate.rate(done), stats)

    def load_report(self) -> dict[str, int | float]:
        """The load a heartbeat carries."""
        return self.load().heartbeat()

    def set_draining(self, draining: bool) -> None:
        if draining != self._state.draining:
            log.info("draining: finishing in-flight requests, taking no new ones" if draining else "ready again")
            self._state.draining = draining
            self._engine.load_changed()

    # ---- helpers ------------------------------------------------------------------------------

    async def _add(self, request: EngineRequest, context: grpc.aio.ServicerContext[Any, Any]) -> RequestHandle:
        try:
            return await self._engine.submit(request)
        except (RequestRejected, KvTransferError) as error:
            code = error.code if isinstance(error, KvTransferError) else grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(error))
            raise  # (context.abort raises; this says so to the type checker)

    async def _constrain(
        self, request: EngineRequest, sampling: worker_pb2.SamplingParams, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Gives a request with a grammar its matcher, past the tokens it already produced (compiled off
        the event loop: a large schema takes a while)."""
        grammar = grammar_from_proto(sampling)
        if grammar is None:
            return
        if self._grammars is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker follows no grammars (it was started without its model's tokenizer)",
            )
            return
        try:
            request.constraint = await asyncio.to_thread(self._grammars.start, grammar, request.generated_token_ids)
        except GrammarRejected as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"SamplingParams.constraint: {error}")

    async def _outputs(
        self, handle: RequestHandle, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[TokenOutput]:
        try:
            while True:
                output = await handle.outputs.get()
                if isinstance(output, RequestFailed):  # its own failure: the message says so
                    await context.abort(grpc.StatusCode.INTERNAL, str(output))
                if isinstance(output, Exception):
                    # The worker's own failure, not the request's: the gateway retries elsewhere.
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker's model step failed: {output}")
                yield output
                if output.finished or handle.request.prefill_only:
                    return
        finally:
            self._engine.abort(handle.request.request_id)

    async def _peer(
        self, decode_address: str, context: grpc.aio.ServicerContext[worker_pb2.PrefillRequest, worker_pb2.PrefillEvent]
    ) -> Peer:
        assert self._sender is not None  # a prefill worker's (checked when the service was made)
        try:
            return await self._sender.resolve(decode_address, self._secret)
        except KvTransferError as error:
            await context.abort(error.code, str(error))
            raise  # (context.abort raises)

    async def _await_kv(
        self,
        request: worker_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DecodeRequest, worker_pb2.TokenEvent],
    ) -> ReceivedKv:
        assert self._receiver is not None  # a decode worker's (checked when the service was made)
        try:
            # Given the prompt, the blocks of it this worker holds are pinned and not sent again.
            return await self._receiver.arrival(
                request.request_id,
                request.transfer_token,
                request.prompt_tokens,
                _remaining(context, self._receiver.receiver.timeouts.kv_wait_s),
                self._engine.kv,
                list(request.prompt_token_ids),
                request.cache_salt,
            )
        except KvTransferError as error:
            await context.abort(error.code, str(error))
            raise  # (context.abort raises)

    async def _admit(self, context: grpc.aio.ServicerContext[Any, Any], *roles: Role) -> None:
        await self._require_role(context, *roles)
        if self._state.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {self._state.worker_id} is draining: it finishes its requests and takes no new ones",
            )

    async def _require_role(self, context: grpc.aio.ServicerContext[Any, Any], *roles: Role) -> None:
        if self._state.role not in roles:
            wanted = " or ".join(str(r) for r in roles)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker serves the {self._state.role} role; this call goes to a {wanted} worker",
            )


def _call_span(name: str, request_id: str, context: grpc.aio.ServicerContext[Any, Any]) -> Span:
    """The span of one worker call, under the gateway's attempt span that its metadata names; the task's
    log lines name the request and trace from now on."""
    parent = context_from_metadata(context.invocation_metadata())
    span = start_span(name, parent, kind=SpanKind.SERVER, attributes={"request_id": request_id})
    bind_request(request_id, trace_id_of(span))
    return span


@contextlib.contextmanager
def _logged_call(call: str, prompt_tokens: int | None = None) -> Iterator[None]:
    """One line when a call ends, naming its request (bound to the task by `_call_span`): how it ended and
    how long it took, so that an operator can follow a request through the workers' logs."""
    started = time.monotonic()
    outcome = "cancelled"
    try:
        yield
        outcome = "done"
    except grpc.aio.AbortError:
        outcome = "refused"
        raise
    except Exception as error:
        outcome = f"failed ({describe_error(error)})"
        raise
    finally:
        prompt = "" if prompt_tokens is None else f", {prompt_tokens} prompt tokens"
        log.info("%s call %s after %.0f ms%s", call, outcome, (time.monotonic() - started) * 1000, prompt)


def _record_queue_and_compute(request: EngineRequest, compute: str, parent: Span, end_ns: int) -> None:
    """The request's time in the scheduler's queue, then its `compute` span up to `end_ns` (timestamps
    the scheduler took: nothing is traced per step or per token)."""
    if not request.queued_ns or not parent.is_recording():
        return
    scheduled = request.scheduled_ns or end_ns
    record_span("worker.queue", parent, request.queued_ns, scheduled)
    if request.scheduled_ns:
        record_span(compute, parent, scheduled, end_ns, cached_tokens=request.num_cached_tokens)


def _record_receive(received: ReceivedKv, span: Span) -> None:
    """kv.receive: under the sender's kv.transfer span when the hello named it, else under this call."""
    parent = context_from_traceparent(received.traceparent) if received.traceparent else span
    attributes: dict[str, str | int] = {
        "kv_bytes": received.nbytes,
        "data_path": received.data_path,
        "first_block": received.first_block,
    }
    record_span("kv.receive", parent, received.started_ns or now_ns(), received.finished_ns or now_ns(), **attributes)


def _awaitable(future: Future[KvSent] | None) -> asyncio.Future[KvSent]:
    if future is None:  # only a request the connector took has a transfer; others failed before it
        raise RuntimeError("the request has no KV transfer")
    return asyncio.wrap_future(future)


def _without_rate(load: worker_pb2.Load) -> bytes:
    copy = worker_pb2.Load()
    copy.CopyFrom(load)
    copy.tokens_per_second = 0.0
    serialized: bytes = copy.SerializeToString(deterministic=True)
    return serialized


def _remaining(context: grpc.aio.ServicerContext[Any, Any], cap: float) -> float:
    remaining = context.time_remaining()
    return cap if remaining is None else max(0.0, min(cap, remaining))
