"""A prefill worker's connector: each request's KV streams to its decode worker while the prompt is
still being computed, a chunk of full blocks at a time (the last, partly filled block with the last
chunk), and the stream ends with the first token. The whole prompt is computed here, but blocks the
decode worker already holds (it says how many when the transfer opens) are not sent (`OutgoingKv`).

Scheduler side: a request that carries `KvTransferParams.send_to` gets a transfer when the engine takes
it (`OutgoingKv` on a thread of its own, connecting at once); each step's `KvSave`s name the blocks its
chunk completes. Worker side: `save_kv` stages them after the forward pass; `wait_for_save` makes sure,
before a step may overwrite them, that blocks of requests that left or were preempted are read by no
chunk still to be sent.
"""

import itertools
import threading
from concurrent.futures import Future

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_common.worker_credential import WorkerSecret, new_challenge
from workers.engine.connector import KvConnector, KvConnectorStats, KvSent
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_transfer import KvConnectorMeta, KvSave, Peer
from workers.engine.request import EngineRequest, FinishReason
from workers.engine.schedule import SchedulerOutput
from workers.kv_connector.sender import KvSender, OutgoingKv, peer_from_endpoint
from workers.kv_connector.wire import KvTransferError
from workers.runner.kv_pool import KvSource

# Why a transfer stops without a first token, as its decode worker reports it.
ABORT_REASONS = {
    FinishReason.STOPPED: "the request finished at its first token; no KV follows",
    FinishReason.ABORTED: "the prefill request was cancelled",
    FinishReason.FAILED: "the prefill request failed on the prefill worker",
}


class _Transfer:
    def __init__(self, outgoing: OutgoingKv) -> None:
        self.outgoing = outgoing
        self.blocks_saved = 0  # blocks handed to the transfer so far
        self.finished = False  # its request left: dropped once a step waited for its saves


class PrefillConnector(KvConnector):
    def __init__(self, sender: KvSender) -> None:
        self.sender = sender
        self._peers: dict[str, Peer] = {}  # decode worker address → its data port, learnt once
        self._transfers: dict[str, _Transfer] = {}  # by request id; changed on the event loop only
        self._freed: list[str] = []  # requests whose blocks were freed since the last step's meta

    # ---- decode workers ------------------------------------------------------------------------------

    def peer(self, decode_address: str) -> Peer | None:
        return self._peers.get(decode_address)

    async def resolve(self, decode_address: str, secret: WorkerSecret) -> Peer:
        """The decode worker's data port, asked for once (with a challenge it must answer with the worker
        RPC secret) and remembered; a KvTransferError says why it cannot be sent KV."""
        peer = self._peers.get(decode_address)
        if peer is not None:
            return peer
        challenge = new_challenge()
        try:
            async with grpc.aio.insecure_channel(decode_address) as channel:
                endpoint = await worker_pb2_grpc.WorkerStub(channel).GetKvEndpoint(
                    worker_pb2.KvEndpointRequest(challenge=challenge),
                    timeout=self.sender.timeouts.endpoint_s,
                    metadata=secret.metadata(),
                )
        except grpc.aio.AioRpcError as error:
            raise KvTransferError(
                grpc.StatusCode.UNAVAILABLE,
                f"could not reach the decode worker at {decode_address} for its KV endpoint: "
                f"{error.code().name}: {error.details()}",
            ) from None
        if not secret.proves(challenge, endpoint):
            raise KvTransferError(
                grpc.StatusCode.UNAVAILABLE,
                f"the worker at {decode_address} could not prove it is a registered decode worker "
                "(its KV endpoint carries no valid proof of the worker RPC secret); no KV is sent to it",
            )
        return self.learn_peer(decode_address, endpoint)

    def learn_peer(self, decode_address: str, endpoint: worker_pb2.KvEndpoint) -> Peer:
        """Checks a decode worker's KvEndpoint (layout, shared memory) and remembers where it is."""
        peer = peer_from_endpoint(
            decode_address, endpoint, self.sender.layout, self.sender.allow_shm, self.sender.host_id
        )
        self._peers[decode_address] = peer
        return peer

    def forget_peer(self, decode_address: str) -> None:
        """A transfer to it failed: its endpoint is asked again next time (it may have restarted)."""
        self._peers.pop(decode_address, None)

    # ---- scheduler side ------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> Future[KvSent] | None:
        params = request.kv_transfer
        if params is None or params.send_to is None:
            return None
        outgoing = self.sender.open(
            request.request_id, params.transfer_token, request.prompt_token_ids, params.send_to, params.traceparent
        )
        self._transfers[request.request_id] = _Transfer(outgoing)
        return _send_in_own_thread(outgoing)

    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        saves = []
        for chunk in out.chunks:
            request = chunk.request
            transfer = self._transfers.get(request.request_id)
            if transfer is None:
                continue
            computed = chunk.start + chunk.num_tokens
            prompt_done = computed >= len(request.prompt_token_ids)
            upto = kv.blocks_for(computed) if prompt_done else computed // kv.block_size
            if upto > transfer.blocks_saved:
                block_ids = kv.block_ids(request.request_id)
                # The prefix-cache hit is staged apart from what this step computed: a receiver that holds
                # the same prefix then skips that chunk whole, even when the hello's answer comes late.
                hit = request.num_cached_tokens // kv.block_size
                cuts = [transfer.blocks_saved] + ([hit] if transfer.blocks_saved < hit < upto else []) + [upto]
                for start, end in itertools.pairwise(cuts):
                    saves.append(KvSave(request.request_id, block_ids[start:end], start))
                transfer.blocks_saved = upto
        freed, self._freed = self._freed, []
        return KvConnectorMeta(saves=saves, freed=freed)

    def request_preempted(self, request: EngineRequest) -> None:
        # Blocks already sent stay sent: the recomputed KV of the same tokens is the same.
        if request.request_id in self._transfers:
            self._freed.append(request.request_id)

    def request_finished(self, request: EngineRequest) -> None:
        transfer = self._transfers.get(request.request_id)
        if transfer is None:
            return
        transfer.finished = True
        self._freed.append(request.request_id)
        if request.finish_reason is FinishReason.HANDED_OFF:
            transfer.outgoing.finish(request.output_token_ids[0])
        else:
            transfer.outgoing.abort(ABORT_REASONS[request.finish_reason or FinishReason.ABORTED])

    def step_done(self, meta: KvConnectorMeta) -> None:
        for request_id in meta.freed:
            transfer = self._transfers.get(request_id)
            if transfer is not None and transfer.finished:
                del self._transfers[request_id]

    def stats(self) -> KvConnectorStats:
        return KvConnectorStats(sent_by_path=self.sender.sent.snapshot())

    async def close(self) -> None:
        self.sender.close()

    # ---- worker side ---------------------------------------------------------------------------------

    def wait_for_save(self, meta: KvConnectorMeta) -> None:
        for request_id in meta.freed:
            self._transfers[request_id].outgoing.wait_sent()

    def save_kv(self, meta: KvConnectorMeta, runner: KvSource) -> None:
        for save in meta.saves:
            self._transfers[save.request_id].outgoing.write_blocks(runner, save.block_ids, save.first_block)


def _send_in_own_thread(outgoing: OutgoingKv) -> Future[KvSent]:
    """A transfer must start as soon as its request is queued (its chunks may point into the KV pool),
    so it never waits for a free thread in a pool."""
    future: Future[KvSent] = Future()
    future.set_running_or_notify_cancel()  # its outcome is always delivered: no one can cancel it

    def run() -> None:
        try:
            nbytes = outgoing.send()
        except Exception as error:
            future.set_exception(error)
        else:
            future.set_result(KvSent(nbytes, outgoing.data_path))

    threading.Thread(target=run, name="kv-send", daemon=True).start()
    return future
