"""Prefill, decode and colocated workers served in this process over real gRPC, the KV moving between them
on the real data path: what the worker tests and the KV benchmarks drive."""

import asyncio
import secrets

import grpc

from diptych_common.credential_server import worker_server
from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_common.worker_credential import WorkerSecret, attach_worker_secret
from workers.engine.connector import KvConnector
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.multi import composed
from workers.kv_connector.nixl import RegisteredStaging
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.tier import TierConnector
from workers.kv_tier.blocks import tier_namespace
from workers.kv_tier.client import TierClient
from workers.runner.model_runner import ModelRunner
from workers.serving.server import Role, WorkerService, WorkerState
from workers.structured.compiler import GrammarCompiler

SECRET = "local-worker-rpc-secret"


class Worker:
    """A worker of `role` ("prefill", "decode" or "colocated", the roles of `diptych worker --role`) on
    `model`: engine (unless told, 128 blocks of 16 tokens, 64 tokens a step, context 1024), its KV
    connector (a prefill worker sends, a decode worker receives), its grammar compiler when given
    (structured outputs) and its gRPC service on loopback. `runner`: the engine's model runner when the
    caller built it (on a device, with CUDA graphs); by default one on the CPU with the config's blocks.
    `nixl`: its NIXL agent's staging buffers (the KV then moves over NIXL where shared memory is not
    allowed). `kv_tier`: HOST:PORT of a KV tier store it shares prefix blocks through (as the blocks of
    `model_name`)."""

    def __init__(
        self,
        role: str,
        model,
        executor,
        allow_shm: bool,
        secret: str = SECRET,
        config: EngineConfig | None = None,
        context_length: int = 1024,
        grammars: GrammarCompiler | None = None,
        runner: ModelRunner | None = None,
        nixl: RegisteredStaging | None = None,
        kv_tier: str = "",
        model_name: str = "diptych-tiny",
    ) -> None:
        role = Role(role)
        self.secret = WorkerSecret(secret)
        config = config or EngineConfig(num_kv_blocks=128, token_budget=64)
        runner = runner or ModelRunner(model, config.num_kv_blocks, config.block_size)
        self.engine = Engine(runner, config, StopCriteria(frozenset(), context_length), executor)
        self.receiver: KvReceiver | None = None
        self.sender: KvSender | None = None
        self.tier: TierConnector | None = None
        connectors: list[KvConnector] = []
        if role is Role.DECODE:
            self.receiver = KvReceiver(KvInbox(), runner.layout, nixl=nixl)
            connectors.append(DecodeConnector(self.receiver))
        if role is Role.PREFILL:
            self.sender = KvSender(runner.layout, allow_shm=allow_shm, nixl=nixl)
            connectors.append(PrefillConnector(self.sender))
        if kv_tier:
            namespace = tier_namespace(model_name, runner.layout)
            client = TierClient(kv_tier, namespace, runner.layout.block_nbytes, self.secret)
            self.tier = TierConnector(client, self.engine.kv, runner, executor)
            connectors.append(self.tier)
        self.engine.attach_connector(composed(connectors))
        self.state = WorkerState(role, worker_id=f"{role}-0")
        self.service = WorkerService(self.state, self.engine, secret=self.secret, grammars=grammars)

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
        await self.engine.connector.close()


async def split_calls(
    prefill: Worker,
    decode: Worker,
    request_id: str,
    prompt: list[int],
    sampling: worker_pb2.SamplingParams,
    cache_salt: str = "",
    give_prompt: bool = False,
):
    """A split request's two calls as the gateway places them: the decode call first (it waits for the KV),
    then the prefill call that sends it, with one fresh transfer token; returns (decode call, prefill call).
    `give_prompt`: the decode call gives its prompt's token ids, as the gateway's does (the decode worker
    then pins the blocks of it it holds, and they are not sent)."""
    token = secrets.token_bytes(32)
    decode_call = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            transfer_token=token,
            sampling=sampling,
            prompt_tokens=len(prompt),
            cache_salt=cache_salt,
            prompt_token_ids=prompt if give_prompt else [],
        )
    )
    prefill_call = prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            decode_address=decode.address,
            transfer_token=token,
            cache_salt=cache_salt,
        )
    )
    return decode_call, prefill_call
