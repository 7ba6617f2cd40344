"""Runs a planned request on its route and yields every output token, the first one included.

Split mode opens the decode call first (so the decode worker expects the KV cache and its one-time
transfer token), then the prefill call, which returns the first token and pushes the KV cache straight
to the decode worker; the KV cache never passes through here. Leaving the generator early cancels
both calls, which frees the KV cache on both workers.
"""

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from gateway.errors import GatewayError
from gateway.metrics import WORKER_BYTES_RECEIVED
from gateway.registry import WorkerInfo
from gateway.routing import Route
from gateway.validation import GenerationPlan


@dataclass
class PhaseRecord:
    worker: WorkerInfo
    started_at: datetime
    finished_at: datetime | None = None
    compute_ms: int = 0
    kv_bytes: int = 0
    cached_tokens: int = 0


@dataclass
class RequestTrace:
    """What each phase did, for usage: filled in as the request runs."""
    prefill: PhaseRecord | None = None
    decode: PhaseRecord | None = None


class RequestPath:
    def __init__(self, call_timeout_s: float = 300.0) -> None:
        self._call_timeout_s = call_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def run(self, plan: GenerationPlan, route: Route, trace: RequestTrace) -> AsyncIterator[worker_pb2.TokenEvent]:
        """The request's output tokens. Close the iterator (contextlib.aclosing) to cancel the worker calls."""
        return self._colocated(plan, route, trace) if route.colocated else self._split(plan, route, trace)

    async def _split(self, plan: GenerationPlan, route: Route, trace: RequestTrace):
        transfer_token = secrets.token_bytes(32)
        decode_call = self._stub(route.decode).Decode(
            worker_pb2.DecodeRequest(
                request_id=plan.request_id, transfer_token=transfer_token, sampling=plan.sampling,
                prompt_tokens=len(plan.prompt_token_ids),
            ),
            timeout=self._call_timeout_s,
        )
        prefill_call = self._stub(route.prefill).Prefill(
            worker_pb2.PrefillRequest(
                request_id=plan.request_id, prompt_token_ids=plan.prompt_token_ids, sampling=plan.sampling,
                decode_address=route.decode.address, transfer_token=transfer_token,
            ),
            timeout=self._call_timeout_s,
        )
        trace.prefill = PhaseRecord(route.prefill, started_at=_now())
        try:
            first = (await _read(prefill_call, route.prefill, "prefill")).first_token
            trace.prefill.finished_at = _now()
            trace.prefill.compute_ms = first.compute_ms
            trace.prefill.cached_tokens = first.cached_tokens
            yield worker_pb2.TokenEvent(
                token_id=first.token_id, finished=first.finished, finished_by_eos=first.finished_by_eos
            )
            if first.finished:
                return
            trace.decode = PhaseRecord(route.decode, started_at=_now())
            async for event in _stream(decode_call, route.decode, "decode"):
                if event.finished:
                    trace.decode.compute_ms = event.stats.compute_ms
                    delivered = (await _read(prefill_call, route.prefill, "prefill")).kv_delivered
                    trace.prefill.kv_bytes = trace.decode.kv_bytes = delivered.kv_bytes
                yield event
        finally:
            _finish(trace.decode)
            decode_call.cancel()
            prefill_call.cancel()

    async def _colocated(self, plan: GenerationPlan, route: Route, trace: RequestTrace):
        call = self._stub(route.prefill).Generate(
            worker_pb2.GenerateWork(
                request_id=plan.request_id, prompt_token_ids=plan.prompt_token_ids, sampling=plan.sampling
            ),
            timeout=self._call_timeout_s,
        )
        trace.prefill = PhaseRecord(route.prefill, started_at=_now())
        try:
            async for event in _stream(call, route.prefill, "colocated"):
                if trace.decode is None:
                    trace.prefill.finished_at = _now()
                    trace.prefill.compute_ms = event.stats.compute_ms
                    trace.decode = PhaseRecord(route.prefill, started_at=trace.prefill.finished_at)
                elif event.finished:
                    trace.decode.compute_ms = event.stats.compute_ms
                yield event
        finally:
            _finish(trace.decode)
            call.cancel()

    def _stub(self, worker: WorkerInfo) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(worker.address)
        if channel is None:
            channel = self._channels[worker.address] = grpc.aio.insecure_channel(worker.address)
        return worker_pb2_grpc.WorkerStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def _read(call, worker: WorkerInfo, phase: str):
    try:
        message = await call.read()
    except grpc.aio.AioRpcError as error:
        raise _worker_failure(error, worker, phase) from None
    if message is grpc.aio.EOF:
        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"the {phase} worker {worker.id} ended its stream early")
    WORKER_BYTES_RECEIVED.inc(message.ByteSize())
    return message


async def _stream(call, worker: WorkerInfo, phase: str):
    try:
        async for message in call:
            WORKER_BYTES_RECEIVED.inc(message.ByteSize())
            yield message
    except grpc.aio.AioRpcError as error:
        raise _worker_failure(error, worker, phase) from None


def _worker_failure(error: grpc.aio.AioRpcError, worker: WorkerInfo, phase: str) -> GatewayError:
    code = grpc.StatusCode.DEADLINE_EXCEEDED if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED else grpc.StatusCode.UNAVAILABLE
    return GatewayError(code, f"the {phase} worker {worker.id} failed ({error.code().name}: {error.details()}); retry the request")


def _finish(record: PhaseRecord | None) -> None:
    if record is not None and record.finished_at is None:
        record.finished_at = _now()


def _now() -> datetime:
    return datetime.now(UTC)
