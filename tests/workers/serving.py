"""Prefill, decode and colocated workers served in process over real gRPC, the KV moving between them on
the data path: what the worker tests (and the model-family tests) drive."""

import asyncio
import secrets

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_common.worker_credential import WorkerSecret, attach_worker_secret
from workers.authentication import worker_server
from workers.engine import Engine, EngineConfig
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.model_runner import ModelRunner
from workers.sampling import StopCriteria
from workers.server import Role, WorkerService, WorkerState

SECRET = "tests-worker-rpc-secret"


class Worker:
    """A worker of `role` on `model`: engine (128 blocks of 16 tokens, 64 tokens a step, context 1024),
    its KV connector (a prefill worker sends, a decode worker receives) and its gRPC service."""

    def __init__(self, role: Role, model, executor, allow_shm: bool, secret: str = SECRET) -> None:
        self.secret = WorkerSecret(secret)
        config = EngineConfig(num_kv_blocks=128, token_budget=64)
        runner = ModelRunner(model, config.num_kv_blocks, config.block_size)
        self.engine = Engine(runner, config, StopCriteria(frozenset(), 1024), executor)
        self.receiver: KvReceiver | None = None
        self.sender: KvSender | None = None
        if role is Role.DECODE:
            self.receiver = KvReceiver(KvInbox(), runner.layout)
            self.engine.attach_connector(DecodeConnector(self.receiver))
        if role is Role.PREFILL:
            self.sender = KvSender(runner.layout, allow_shm=allow_shm)
            self.engine.attach_connector(PrefillConnector(self.sender))
        self.state = WorkerState(role, worker_id=f"{role}-0")
        self.service = WorkerService(self.state, self.engine, secret=self.secret)

    async def start(self) -> None:
        if self.receiver:
            self.receiver.start()
        self.server = worker_server(self.secret)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.service, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.task = asyncio.create_task(self.engine.run())
        self.channel = grpc.aio.insecure_channel(self.address, interceptors=attach_worker_secret(self.secret))
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    async def stop(self) -> None:
        self.task.cancel()
        await self.channel.close()
        await self.server.stop(None)
        if self.engine.connector is not None:
            self.engine.connector.close()


def sampling(count: int) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)


async def split(
    prefill, decode, request_id: str, prompt: list[int], count: int, cache_salt: str = "", give_prompt: bool = False
):
    """One split request: the decode call first, then the prefill call that sends it the KV; returns the
    prefill call's events and the decode call's. `give_prompt`: the decode call gives its prompt's token
    ids, as the gateway's does (the decode worker then pins the blocks of it it holds, and they are not sent)."""
    token = secrets.token_bytes(32)
    decode_call = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            transfer_token=token,
            sampling=sampling(count),
            prompt_tokens=len(prompt),
            cache_salt=cache_salt,
            prompt_token_ids=prompt if give_prompt else [],
        )
    )
    prefill_events = [
        e
        async for e in prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling(count),
                decode_address=decode.address,
                transfer_token=token,
                cache_salt=cache_salt,
            )
        )
    ]
    rest = [e async for e in decode_call]
    return prefill_events, rest
