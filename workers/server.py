"""The worker's gRPC service. Prefill workers serve Prefill; decode workers serve Decode, Generate and
GetKvEndpoint; colocated workers serve Generate. Every role serves GetLoad and WatchLoad."""

import asyncio
import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_common.worker_credential import WorkerSecret, new_challenge
from workers.engine import Engine, RequestFailed, RequestHandle, RequestRejected
from workers.kv_transfer import KvReceiver, KvSender, KvTransferError, Peer, ReceivedKv, dtype_name, peer_from_endpoint
from workers.request import BATCH, INTERACTIVE, EngineRequest, ImportedKv
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)

KV_ARRIVAL_TIMEOUT_S = 30.0
ENDPOINT_TIMEOUT_S = 5.0
LOAD_MIN_INTERVAL_S = 0.05
LOAD_MAX_INTERVAL_S = 1.0


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
    )


def _priority(value: int) -> int:
    return BATCH if value == worker_pb2.PRIORITY_BATCH else INTERACTIVE


class RateMeter:
    """Tokens per second over the last `window` seconds."""

    def __init__(self, window: float = 10.0) -> None:
        self._window = window
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, total: int) -> float:
        now = time.monotonic()
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        first_time, first_total = self._samples[0]
        return (total - first_total) / (now - first_time) if now - first_time > 0.1 else 0.0


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        state: WorkerState,
        engine: Engine,
        receiver: KvReceiver | None = None,
        sender: KvSender | None = None,
        secret: WorkerSecret | None = None,
    ) -> None:
        self._state = state
        self._secret = secret or WorkerSecret()
        self._engine = engine
        self._receiver = receiver
        self._sender = sender
        self._rate = RateMeter()

    # ---- serving ------------------------------------------------------------------------------

    async def Prefill(self, request, context):
        await self._admit(context, Role.PREFILL)
        prompt = list(request.prompt_token_ids)
        peer = await self._peer(request.decode_address, context)
        outgoing = self._sender.open(request.request_id, request.transfer_token, prompt, peer)
        engine_request = EngineRequest(
            request.request_id, prompt, sampling_from_proto(request.sampling), _priority(request.priority),
            prefill_only=True, kv_stage=outgoing, cache_salt=request.cache_salt,
        )
        handle = await self._add(engine_request, context, on_reject=outgoing.release)
        transfer = _in_own_thread(outgoing.send)
        try:
            first = await anext(self._outputs(handle, context))
            yield worker_pb2.PrefillEvent(first_token=worker_pb2.FirstToken(
                token_id=first.token_id, cached_tokens=engine_request.num_cached_tokens,
                compute_ms=round(handle.compute_ms), worker_id=self._state.worker_id,
                finished=first.finished, finished_by_eos=first.finished_by_eos,
            ))
            if first.finished:
                outgoing.abort("the request finished at its first token; no KV follows")
                await asyncio.gather(transfer, return_exceptions=True)
                yield worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KvDelivered())
                return
            started = time.monotonic()
            outgoing.finish(first.token_id)
            try:
                nbytes = await transfer
            except KvTransferError as error:
                self._sender.peers.pop(request.decode_address, None)
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"could not deliver the KV cache to the decode worker at {request.decode_address}: "
                    f"{error.code.name}: {error}",
                )
            yield worker_pb2.PrefillEvent(kv_delivered=worker_pb2.KvDelivered(
                kv_bytes=nbytes, transfer_ms=round((time.monotonic() - started) * 1000),
                data_path=outgoing.data_path,
            ))
        finally:
            if not transfer.done():
                outgoing.abort("the prefill request was cancelled")

    async def Decode(self, request, context):
        await self._admit(context, Role.DECODE)
        received = await self._await_kv(request, context)
        engine_request = EngineRequest(
            request.request_id, received.prompt_token_ids, sampling_from_proto(request.sampling),
            _priority(request.priority), output_token_ids=[received.first_token_id],
            imported_kv=ImportedKv(received.num_tokens, received.chunks, received.release),
            cache_salt=request.cache_salt,
        )
        handle = await self._add(engine_request, context, on_reject=received.release)
        async for output in self._outputs(handle, context):
            stats = None
            if output.finished:
                stats = worker_pb2.PhaseStats(
                    worker_id=self._state.worker_id, compute_ms=round(handle.compute_ms), kv_bytes=received.nbytes
                )
            yield worker_pb2.TokenEvent(
                token_id=output.token_id, finished=output.finished, finished_by_eos=output.finished_by_eos,
                stats=stats,
            )

    async def Generate(self, request, context):
        await self._admit(context, Role.COLOCATED, Role.DECODE)
        engine_request = EngineRequest(
            request.request_id, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
            _priority(request.priority), cache_salt=request.cache_salt,
        )
        handle = await self._add(engine_request, context)
        first = True
        async for output in self._outputs(handle, context):
            stats = None
            if first or output.finished:
                stats = worker_pb2.PhaseStats(
                    worker_id=self._state.worker_id, compute_ms=round(handle.compute_ms),
                    cached_tokens=engine_request.num_cached_tokens,
                )
            first = False
            yield worker_pb2.TokenEvent(
                token_id=output.token_id, finished=output.finished, finished_by_eos=output.finished_by_eos,
                stats=stats,
            )

    async def GetKvEndpoint(self, request, context):
        await self._require_role(context, Role.DECODE)
        receiver = self._receiver
        endpoint = worker_pb2.KvEndpoint(
            data_host=receiver.host, data_port=receiver.port, shm_probe_name=receiver.shm_probe_name,
            shm_probe_nonce=receiver.shm_probe_nonce, block_size=receiver.layout.block_size,
            dtype=dtype_name(receiver.layout.dtype),
        )
        endpoint.proof = self._secret.endpoint_proof(request.challenge, endpoint)
        return endpoint

    # ---- load ---------------------------------------------------------------------------------

    async def GetLoad(self, request, context):
        return self.load()

    async def WatchLoad(self, request, context):
        changed = self._engine.watch_load()
        try:
            last_key, last_sent = None, 0.0
            while True:
                load = self.load()
                key = _without_rate(load)
                now = time.monotonic()
                if key != last_key or now - last_sent >= LOAD_MAX_INTERVAL_S:
                    yield load
                    last_key, last_sent = key, now
                changed.clear()
                await asyncio.sleep(LOAD_MIN_INTERVAL_S)
                try:
                    await asyncio.wait_for(changed.wait(), max(0.0, LOAD_MAX_INTERVAL_S - (time.monotonic() - last_sent)))
                except TimeoutError:
                    pass
        finally:
            self._engine.unwatch_load(changed)

    def load(self) -> worker_pb2.Load:
        engine, kv = self._engine, self._engine.kv
        return worker_pb2.Load(
            worker_id=self._state.worker_id,
            queue_depth=engine.num_waiting,
            active_sequences=engine.num_active,
            kv_bytes_received=self._receiver.bytes_received if self._receiver else 0,
            kv_bytes_sent=self._sender.bytes_sent if self._sender else 0,
            tokens_per_second=self.tokens_per_second,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            block_size=kv.block_size,
            waiting_interactive=engine.waiting(INTERACTIVE),
            waiting_batch=engine.waiting(BATCH),
            prompt_tokens_pending=engine.scheduler.prompt_tokens_pending,
            draining=self._state.draining,
            prefix_cache=worker_pb2.PrefixCacheSummary(
                version=kv.pool.version, block_hashes=kv.cached_block_hashes(),
                hits_tokens=kv.hits_tokens, queried_tokens=kv.queried_tokens,
            ),
        )

    @property
    def tokens_per_second(self) -> float:
        engine = self._engine
        done = engine.prompt_tokens_computed if self._state.role is Role.PREFILL else engine.tokens_generated
        return self._rate.rate(done)

    def load_report(self) -> dict:
        """The load a heartbeat carries."""
        return {
            "queue_depth": self._engine.num_waiting,
            "active_sequences": self._engine.num_active,
            "kv_blocks_free": self._engine.kv.num_free_blocks,
            "kv_blocks_total": self._engine.kv.num_blocks,
            "tokens_per_second": round(self.tokens_per_second, 2),
        }

    def set_draining(self, draining: bool) -> None:
        if draining != self._state.draining:
            log.info("draining: finishing in-flight requests, taking no new ones" if draining else "ready again")
            self._state.draining = draining
            self._engine.load_changed()

    # ---- helpers ------------------------------------------------------------------------------

    async def _add(self, request: EngineRequest, context, on_reject=None) -> RequestHandle:
        try:
            return self._engine.add(request)
        except RequestRejected as error:
            if on_reject is not None:
                on_reject()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    async def _outputs(self, handle: RequestHandle, context):
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

    async def _peer(self, decode_address: str, context) -> Peer:
        peer = self._sender.peers.get(decode_address)
        if peer is not None:
            return peer
        challenge = new_challenge()
        try:
            async with grpc.aio.insecure_channel(decode_address) as channel:
                endpoint = await worker_pb2_grpc.WorkerStub(channel).GetKvEndpoint(
                    worker_pb2.KvEndpointRequest(challenge=challenge), timeout=ENDPOINT_TIMEOUT_S,
                    metadata=self._secret.metadata(),
                )
            if not self._secret.proves(challenge, endpoint):
                raise KvTransferError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the worker at {decode_address} could not prove it is a registered decode worker "
                    "(its KV endpoint carries no valid proof of the worker RPC secret); no KV is sent to it",
                )
            peer = peer_from_endpoint(decode_address, endpoint, self._sender.layout, self._sender.allow_shm)
        except grpc.aio.AioRpcError as error:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not reach the decode worker at {decode_address} for its KV endpoint: "
                f"{error.code().name}: {error.details()}",
            )
        except KvTransferError as error:
            await context.abort(error.code, str(error))
        self._sender.peers[decode_address] = peer
        return peer

    async def _await_kv(self, request, context) -> ReceivedKv:
        loop = asyncio.get_running_loop()
        arrival = loop.create_future()

        def deliver(result) -> None:  # called once, on a receiver thread
            loop.call_soon_threadsafe(_settle, arrival, result)

        if request.prompt_tokens == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "DecodeRequest.prompt_tokens must give the prompt's length: the KV receiver accepts no more",
            )
        try:
            self._receiver.inbox.expect(request.request_id, request.transfer_token, deliver, request.prompt_tokens)
        except KvTransferError as error:
            await context.abort(error.code, str(error))
        try:
            timeout = _remaining(context, KV_ARRIVAL_TIMEOUT_S)
            received = await asyncio.wait_for(arrival, timeout)
        except KvTransferError as error:
            await context.abort(error.code, f"the KV cache transfer failed: {error}")
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the KV cache did not arrive in time")
        finally:
            self._receiver.inbox.forget(request.request_id)
        if received.num_tokens != len(received.prompt_token_ids) or not received.prompt_token_ids:
            received.release()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the KV cache does not cover its prompt")
        return received

    async def _admit(self, context, *roles: Role) -> None:
        await self._require_role(context, *roles)
        if self._state.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {self._state.worker_id} is draining: it finishes its requests and takes no new ones",
            )

    async def _require_role(self, context, *roles: Role) -> None:
        if self._state.role not in roles:
            wanted = " or ".join(str(r) for r in roles)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker serves the {self._state.role} role; this call goes to a {wanted} worker",
            )


def _in_own_thread(function) -> asyncio.Future:
    """Runs a blocking transfer on a thread of its own: a transfer must start as soon as its request is
    queued (its chunks point into the KV pool), so it can never wait for a free thread in a pool."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result = function()
        except Exception as error:
            loop.call_soon_threadsafe(_settle, future, error)
        else:
            loop.call_soon_threadsafe(_settle, future, result)

    threading.Thread(target=run, name="kv-send", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result) -> None:
    if future.done():
        if isinstance(result, ReceivedKv):
            result.release()  # nobody waits for it any more
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


def _without_rate(load: worker_pb2.Load) -> bytes:
    copy = worker_pb2.Load()
    copy.CopyFrom(load)
    copy.tokens_per_second = 0.0
    return copy.SerializeToString(deterministic=True)


def _remaining(context, cap: float) -> float:
    remaining = context.time_remaining()
    return cap if remaining is None else max(0.0, min(cap, remaining))
