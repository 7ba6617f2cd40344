"""A decode worker's connector: prefill workers send KV to its data port; a request's KV is written
into its blocks in the step that admits it, and the request computes only its next token.

The server awaits a decode call's KV (`arrival`: the call registered with `expect`, the wait, the checks
that the cache covers its prompt, each failure a KvTransferError); what arrived belongs to the connector
until the engine takes the request (`add_request`), and what the engine never took goes back when the
call ends (`forget`). Once loaded, the staging buffer goes back after the step (`step_done`).

A call that gives its prompt pins the longest prefix of it this worker's prefix cache holds (a
reservation in the KV cache manager, under the request's id and organization salt) and the prefill
worker sends only the blocks after it. The reservation is the connector's until the engine takes the
request: then the request's (its block table starts with it at admission, or it is released when the
request leaves first); a call that ends before releases it (`forget`).
"""

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import grpc

from workers.engine.connector import KvConnector, KvConnectorStats
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_transfer import KvConnectorMeta, KvLoad
from workers.engine.request import EngineRequest
from workers.engine.schedule import SchedulerOutput
from workers.kv_connector.receiver import KvReceiver, ReceivedKv
from workers.kv_connector.wire import KvTransferError, dtype_name
from workers.runner.kv_pool import KvPool


@dataclasses.dataclass(frozen=True)
class DataEndpoint:
    """Where and how a prefill worker sends this worker KV (the fields of worker_pb2.KvEndpoint)."""

    data_host: str
    data_port: int
    shm_probe_name: str
    shm_probe_nonce: bytes
    block_size: int
    dtype: str
    nixl: bool


class DecodeConnector(KvConnector):
    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver
        self._lock = threading.Lock()  # receiver threads deliver
        self._waiting: dict[str, Future[ReceivedKv]] = {}  # decode calls waiting for their KV
        self._arrived: dict[str, ReceivedKv] = {}  # arrived, not taken by the engine yet
        self._taken: dict[str, ReceivedKv] = {}  # taken by the engine, to load (the event loop's only)
        self._reserved: dict[str, KVCacheManager] = {}  # calls whose pinned prefix is still ours (event loop)
        self._kv: KVCacheManager | None = None  # the engine's, once a call pinned a prefix in it

    def endpoint(self) -> DataEndpoint:
        receiver = self.receiver
        return DataEndpoint(
            receiver.host,
            receiver.port,
            receiver.shm_probe_name,
            receiver.shm_probe_nonce,
            receiver.layout.block_size,
            dtype_name(receiver.layout.dtype),
            receiver.nixl is not None,
        )

    # ---- decode calls ---------------------------------------------------------------------------------

    def expect(
        self,
        request_id: str,
        transfer_token: bytes,
        prompt_tokens: int,
        kv: KVCacheManager | None = None,
        prompt_token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> Future[ReceivedKv]:
        """Registers a decode call: the KV that carries its token, of a prompt of at most `prompt_tokens`,
        arrives on the returned future (or the KvTransferError that stopped it). Given the engine's `kv`
        and the prompt, the blocks of it `kv` holds under `cache_salt` are pinned and not sent again."""
        held = self._reserve(request_id, kv, prompt_token_ids, cache_salt) if kv is not None and prompt_token_ids else 0
        arrival: Future[ReceivedKv] = Future()
        try:
            with self._lock:  # a delivery waits until the call is registered
                self.receiver.inbox.expect(
                    request_id,
                    transfer_token,
                    lambda result: self._deliver(request_id, arrival, result),
                    prompt_tokens,
                    held,
                    tuple(prompt_token_ids),
                )
                self._waiting[request_id] = arrival
        except BaseException:
            self._release_reservation(request_id)
            raise
        return arrival

    async def arrival(
        self,
        request_id: str,
        transfer_token: bytes,
        prompt_tokens: int,
        timeout: float,
        kv: KVCacheManager | None = None,
        prompt_token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> ReceivedKv:
        """Registers a decode call (`expect`) and waits up to `timeout` seconds for its KV; a
        KvTransferError says why none came. On any failure the call is forgotten; on success the caller
        forgets it once the engine took the request (what it did not take goes back then)."""
        if prompt_tokens == 0:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "DecodeRequest.prompt_tokens must give the prompt's length: the KV receiver accepts no more",
            )
        arrival = self.expect(request_id, transfer_token, prompt_tokens, kv, prompt_token_ids, cache_salt)
        try:
            received = await _arrived(arrival, timeout)
            if received.num_tokens != len(received.prompt_token_ids) or not received.prompt_token_ids:
                raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV cache does not cover its prompt")
            return received
        except BaseException:  # a failed transfer, no KV in time, a bad cache, or the call cancelled
            self.forget(request_id)
            raise

    def _reserve(self, request_id: str, kv: KVCacheManager, prompt_token_ids: Sequence[int], cache_salt: str) -> int:
        try:
            held = kv.reserve_prefix(request_id, prompt_token_ids, cache_salt)
        except ValueError as error:  # another call of this id holds blocks: it is left alone
            raise KvTransferError(grpc.StatusCode.ALREADY_EXISTS, str(error)) from None
        self._kv = kv
        self._reserved[request_id] = kv
        return held

    def _release_reservation(self, request_id: str) -> None:
        kv = self._reserved.pop(request_id, None)
        if kv is not None:
            kv.release_reservation(request_id)

    def forget(self, request_id: str) -> None:
        """The decode call no longer waits: KV that arrived for it and that the engine did not take goes
        back, and so do the blocks pinned for it."""
        self.receiver.inbox.forget(request_id)
        with self._lock:
            self._waiting.pop(request_id, None)
            arrived = self._arrived.pop(request_id, None)
        if arrived is not None:
            arrived.release()
        self._release_reservation(request_id)

    def _deliver(self, request_id: str, arrival: Future[ReceivedKv], result: ReceivedKv | KvTransferError) -> None:
        with self._lock:
            wanted = self._waiting.get(request_id) is arrival and arrival.set_running_or_notify_cancel()
            if wanted:
                del self._waiting[request_id]
                if isinstance(result, ReceivedKv):
                    self._arrived[request_id] = result
        if not wanted:
            if isinstance(result, ReceivedKv):
                result.release()  # nobody waits for it any more
        elif isinstance(result, ReceivedKv):
            arrival.set_result(result)
        else:
            arrival.set_exception(result)

    # ---- scheduler side -------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        if request.kv_transfer is None or not request.kv_transfer.load_tokens:
            return None
        with self._lock:
            received = self._arrived.pop(request.request_id, None)
        if received is None:
            raise KvTransferError(
                grpc.StatusCode.FAILED_PRECONDITION, f"no KV cache arrived for request {request.request_id}"
            )
        self._taken[request.request_id] = received
        kv = self._reserved.pop(request.request_id, None)  # the request's now: its table starts with it
        if kv is not None:
            kv.trim_reservation(request.request_id, received.first_block)  # the sender may have sent more
        return None

    def num_external_tokens(self, request: EngineRequest) -> int:
        received = self._taken.get(request.request_id)
        return received.num_tokens if received is not None else 0

    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        return KvConnectorMeta(loads=[KvLoad(r.request_id, kv.block_ids(r.request_id)) for r in out.loads])

    def request_finished(self, request: EngineRequest) -> None:
        self._release(request.request_id)  # it left before its KV was loaded
        if self._kv is not None:
            self._kv.release_reservation(request.request_id)  # ... or before its pinned blocks were its table

    def step_done(self, meta: KvConnectorMeta) -> None:
        for load in meta.loads:
            self._release(load.request_id)

    def _release(self, request_id: str) -> None:
        received = self._taken.pop(request_id, None)
        if received is not None:
            received.release()

    def stats(self) -> KvConnectorStats:
        return KvConnectorStats(received_by_path=self.receiver.received.snapshot())

    async def close(self) -> None:
        self.receiver.close()

    # ---- worker side ----------------------------------------------------------------------------------

    def load_kv(self, meta: KvConnectorMeta, runner: KvPool) -> None:
        for load in meta.loads:
            for chunk in self._taken[load.request_id].chunks:
                count = chunk.data.shape[2]
                runner.write_blocks(load.block_ids[chunk.first_block : chunk.first_block + count], chunk.data)


async def _arrived(arrival: Future[ReceivedKv], timeout: float) -> ReceivedKv:
    try:
        return await asyncio.wait_for(asyncio.wrap_future(arrival), timeout)
    except KvTransferError as error:
        raise KvTransferError(error.code, f"the KV cache transfer failed: {error}") from None
    except TimeoutError:
        raise KvTransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "the KV cache did not arrive in time") from None
