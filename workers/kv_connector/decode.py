"""A decode worker's connector: prefill workers send KV to its data port; a request's KV is written
into its blocks in the step that admits it, and the request computes only its next token.

The server registers a decode call (`expect`) and awaits the KV; what arrived belongs to the connector
until the engine takes the request (`add_request`), and what the engine never took goes back when the
call ends (`forget`). Once loaded, the staging buffer goes back after the step (`step_done`).
"""

import dataclasses
import threading
from concurrent.futures import Future

import grpc

from workers.kv_cache_manager import KVCacheManager
from workers.kv_connector.base import KvConnector, KvConnectorMeta, KvConnectorStats, KvLoad
from workers.kv_connector.receiver import KvReceiver, ReceivedKv
from workers.kv_connector.wire import KvTransferError, dtype_name
from workers.request import EngineRequest
from workers.scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class DataEndpoint:
    """Where and how a prefill worker sends this worker KV (the fields of worker_pb2.KvEndpoint)."""

    data_host: str
    data_port: int
    shm_probe_name: str
    shm_probe_nonce: bytes
    block_size: int
    dtype: str


class DecodeConnector(KvConnector):
    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver
        self._lock = threading.Lock()  # receiver threads deliver
        self._waiting: dict[str, Future[ReceivedKv]] = {}  # decode calls waiting for their KV
        self._arrived: dict[str, ReceivedKv] = {}  # arrived, not taken by the engine yet
        self._taken: dict[str, ReceivedKv] = {}  # taken by the engine, to load (the event loop's only)

    def endpoint(self) -> DataEndpoint:
        receiver = self.receiver
        return DataEndpoint(
            receiver.host,
            receiver.port,
            receiver.shm_probe_name,
            receiver.shm_probe_nonce,
            receiver.layout.block_size,
            dtype_name(receiver.layout.dtype),
        )

    # ---- decode calls ---------------------------------------------------------------------------------

    def expect(self, request_id: str, transfer_token: bytes, prompt_tokens: int) -> Future[ReceivedKv]:
        """Registers a decode call: the KV that carries its token, of a prompt of at most `prompt_tokens`,
        arrives on the returned future (or the KvTransferError that stopped it)."""
        arrival: Future[ReceivedKv] = Future()
        with self._lock:  # a delivery waits until the call is registered
            self.receiver.inbox.expect(
                request_id, transfer_token, lambda result: self._deliver(request_id, arrival, result), prompt_tokens
            )
            self._waiting[request_id] = arrival
        return arrival

    def forget(self, request_id: str) -> None:
        """The decode call no longer waits: KV that arrived for it and that the engine did not take goes back."""
        self.receiver.inbox.forget(request_id)
        with self._lock:
            self._waiting.pop(request_id, None)
            arrived = self._arrived.pop(request_id, None)
        if arrived is not None:
            arrived.release()

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
        return None

    def num_external_tokens(self, request: EngineRequest) -> int:
        received = self._taken.get(request.request_id)
        return received.num_tokens if received is not None else 0

    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        return KvConnectorMeta(loads=[KvLoad(r.request_id, kv.block_ids(r.request_id)) for r in out.loads])

    def request_preempted(self, request: EngineRequest) -> None:
        pass  # its KV was loaded in the step that admitted it: it is recomputed like any other

    def request_finished(self, request: EngineRequest) -> None:
        self._release(request.request_id)  # it left before its KV was loaded

    def step_done(self, meta: KvConnectorMeta) -> None:
        for load in meta.loads:
            self._release(load.request_id)

    def _release(self, request_id: str) -> None:
        received = self._taken.pop(request_id, None)
        if received is not None:
            received.release()

    def stats(self) -> KvConnectorStats:
        return KvConnectorStats(bytes_received=self.receiver.bytes_received)

    def close(self) -> None:
        self.receiver.close()

    # ---- worker side ----------------------------------------------------------------------------------

    def wait_for_save(self, meta: KvConnectorMeta) -> None:
        pass  # it saves nothing

    def save_kv(self, meta: KvConnectorMeta, runner) -> None:
        pass  # it saves nothing

    def load_kv(self, meta: KvConnectorMeta, runner) -> None:
        for load in meta.loads:
            for chunk in self._taken[load.request_id].chunks:
                count = chunk.data.shape[2]
                runner.write_blocks(load.block_ids[chunk.first_block : chunk.first_block + count], chunk.data)
