"""The worker's gRPC service: Prefill, Decode and PushKv for the split roles, Generate for colocated."""

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from workers.decode_engine import DecodeEngine, DecodeSequence
from workers.kv_transfer import KvInbox, KvSender, KvTransferError, kv_chunks
from workers.prefill_engine import PrefillEngine
from workers.sampling import SamplingParams, StopCriteria

log = logging.getLogger(__name__)

KV_PUSH_TIMEOUT_S = 30.0


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
    )


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        state: WorkerState,
        stop: StopCriteria,
        prefill: PrefillEngine | None = None,
        decode: DecodeEngine | None = None,
        inbox: KvInbox | None = None,
        sender: KvSender | None = None,
    ) -> None:
        self._state = state
        self._stop = stop
        self._prefill = prefill
        self._decode = decode
        self._inbox = inbox
        self._sender = sender
        self._started = time.monotonic()

    async def Prefill(self, request, context):
        await self._require_role(Role.PREFILL, context)
        sampling = sampling_from_proto(request.sampling)
        prompt = list(request.prompt_token_ids)
        result = await self._run_prefill(prompt, sampling)
        finished, by_eos = self._stop.check(result.first_token_id, 1, len(prompt), sampling)
        yield worker_pb2.PrefillEvent(first_token=worker_pb2.FirstToken(
            token_id=result.first_token_id, compute_ms=result.compute_ms, worker_id=self._state.worker_id,
            finished=finished, finished_by_eos=by_eos,
        ))
        if finished:
            yield worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KvDelivered())
            return
        chunks = kv_chunks(request.request_id, request.transfer_token, prompt, result.first_token_id, result.kv)
        started = time.monotonic()
        try:
            nbytes = await self._sender.push(request.decode_address, chunks, _remaining(context, KV_PUSH_TIMEOUT_S))
        except grpc.aio.AioRpcError as error:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not deliver the KV cache to the decode worker at {request.decode_address}: "
                f"{error.code().name}: {error.details()}",
            )
        yield worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KvDelivered(
            kv_bytes=nbytes, transfer_ms=round((time.monotonic() - started) * 1000)
        ))

    async def Decode(self, request, context):
        await self._require_role(Role.DECODE, context)
        kv_arrival = self._inbox.expect(request.request_id, request.transfer_token)
        try:
            received = await asyncio.wait_for(kv_arrival, _remaining(context, KV_PUSH_TIMEOUT_S))
        except KvTransferError as error:
            await context.abort(error.code, f"the KV cache transfer failed: {error}")
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the KV cache did not arrive in time")
        finally:
            self._inbox.forget(request.request_id)
        seq = self._decode.add(
            request.request_id, len(received.prompt_token_ids), received.first_token_id, received.kv,
            sampling_from_proto(request.sampling),
        )
        async for event in self._stream_decode(seq):
            yield event

    async def Generate(self, request, context):
        await self._require_role(Role.COLOCATED, context)
        sampling = sampling_from_proto(request.sampling)
        prompt = list(request.prompt_token_ids)
        result = await self._run_prefill(prompt, sampling)
        finished, by_eos = self._stop.check(result.first_token_id, 1, len(prompt), sampling)
        prefill_stats = worker_pb2.PhaseStats(worker_id=self._state.worker_id, compute_ms=result.compute_ms)
        yield worker_pb2.TokenEvent(
            token_id=result.first_token_id, finished=finished, finished_by_eos=by_eos, stats=prefill_stats
        )
        if finished:
            return
        seq = self._decode.add(request.request_id, len(prompt), result.first_token_id, result.kv, sampling)
        async for event in self._stream_decode(seq):
            yield event

    async def PushKv(self, request_iterator, context):
        await self._require_role(Role.DECODE, context)
        try:
            nbytes = await self._inbox.receive(aiter(request_iterator))
        except KvTransferError as error:
            await context.abort(error.code, str(error))
        return worker_pb2.KvAck(bytes_received=nbytes)

    async def GetLoad(self, request, context):
        return worker_pb2.Load(
            worker_id=self._state.worker_id,
            queue_depth=self.queue_depth,
            active_sequences=self.active_sequences,
            kv_bytes_received=self._inbox.bytes_received if self._inbox else 0,
            kv_bytes_sent=self._sender.bytes_sent if self._sender else 0,
            tokens_per_second=self.tokens_per_second,
        )

    @property
    def queue_depth(self) -> int:
        return sum(engine.queue_depth for engine in (self._prefill, self._decode) if engine is not None)

    @property
    def active_sequences(self) -> int:
        return self._decode.active_sequences if self._decode else 0

    def load_report(self) -> dict:
        return {
            "queue_depth": self.queue_depth,
            "active_sequences": self.active_sequences,
            "tokens_per_second": round(self.tokens_per_second, 2),
        }

    @property
    def tokens_per_second(self) -> float:
        tokens = self._decode.tokens_generated if self._decode else self._prefill.prompt_tokens_processed
        return tokens / max(time.monotonic() - self._started, 1e-3)

    async def _run_prefill(self, prompt: list[int], sampling: SamplingParams):
        future = self._prefill.submit(prompt, sampling)
        try:
            return await future
        finally:
            future.cancel()  # drops the prompt from the queue when the caller went away first

    async def _stream_decode(self, seq: DecodeSequence):
        try:
            while True:
                output = await seq.outputs.get()
                stats = None
                if output.finished:
                    stats = worker_pb2.PhaseStats(worker_id=self._state.worker_id, compute_ms=round(seq.compute_ms))
                yield worker_pb2.TokenEvent(
                    token_id=output.token_id, finished=output.finished,
                    finished_by_eos=output.finished_by_eos, stats=stats,
                )
                if output.finished:
                    return
        finally:
            self._decode.abort(seq.request_id)

    async def _require_role(self, role: Role, context) -> None:
        if self._state.role is not role:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker serves the {self._state.role} role; {role} requests go to a {role} worker",
            )


def _remaining(context, cap: float) -> float:
    remaining = context.time_remaining()
    return cap if remaining is None else max(0.0, min(cap, remaining))
