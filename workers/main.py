"""Runs one worker process: loads the model, serves the worker gRPC API (and, on decode workers, the
KV data port) and stays registered."""

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diptych_common.proto.v1 import worker_pb2_grpc
from diptych_common.worker_credential import WorkerSecret
from workers.authentication import worker_server
from workers.decode_graphs import DecodeGraphSpec
from workers.engine import Engine, EngineConfig
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.shm import sweep_stale_files
from workers.kv_connector.staging import StagingPool
from workers.metrics import serve_metrics
from workers.model_loader import load_model
from workers.model_runner import ModelRunner, kv_layout_of
from workers.registration import ControlPlaneLink, RegistrationError
from workers.sampling import StopCriteria
from workers.server import Role, WorkerService, WorkerState

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0
MAX_MESSAGE_BYTES = 64 << 20


def build_engine(loaded, config: EngineConfig, executor) -> Engine:
    """The model runner and engine for a loaded model; the KV pool takes `config.kv_cache_mib`."""
    model = loaded.model.to(config.device)
    layout = kv_layout_of(model.config, config.block_size, next(model.parameters()).dtype)
    num_blocks = config.num_kv_blocks or max(1, (config.kv_cache_mib << 20) // layout.block_nbytes)
    max_blocks = min(num_blocks, -(-loaded.context_length // config.block_size))
    graphs = DecodeGraphSpec(config.max_running, max_blocks) if config.cuda_graphs else None
    runner = ModelRunner(model, num_blocks, config.block_size, config.device, decode_graphs=graphs)
    stop = StopCriteria(loaded.eos_token_ids, loaded.context_length)
    return Engine(runner, replace(config, num_kv_blocks=num_blocks), stop, executor)


async def serve(
    *,
    role: Role,
    model: str,
    model_source: str,
    host: str,
    port: int,
    control_plane_url: str,
    fleet_token: str,
    name: str,
    threads: int,
    engine_config: EngineConfig | None = None,
    kv_port: int = 0,
    metrics_port: int = 0,
) -> None:
    engine_config = engine_config or EngineConfig()
    torch.set_num_threads(threads)
    if swept := sweep_stale_files():
        log.info("removed %d shared-memory files left by workers that no longer run", swept)
    cuda = engine_config.device.startswith("cuda")
    loaded = load_model(model, model_source, dtype=torch.bfloat16 if cuda else torch.float32)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    engine = build_engine(loaded, engine_config, executor)
    layout = engine.runner.layout

    state = WorkerState(role=role)
    secret = WorkerSecret()  # every call is refused until registration hands it over
    receiver = None
    if role is Role.DECODE:
        receiver = KvReceiver(
            KvInbox(),
            layout,
            host=host,
            port=kv_port,
            staging=StagingPool(pin=cuda),
            max_tokens=engine.kv.num_blocks * engine.kv.block_size,
        )
        receiver.start()
        engine.attach_connector(DecodeConnector(receiver))
    if role is Role.PREFILL:
        engine.attach_connector(PrefillConnector(KvSender(layout, pin=cuda)))
    service = WorkerService(state, engine, secret=secret)
    serve_metrics(metrics_port, host, role.value, lambda: service.load().to_proto(), engine)

    server = worker_server(
        secret,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    address = f"{host}:{bound_port}"

    link = ControlPlaneLink(
        control_plane_url,
        fleet_token,
        address,
        name,
        service.load_report,
        on_state=lambda _: service.set_draining(link.draining),
        secret=secret,
    )
    await link.register_until_accepted()
    if link.fleet.get("model") != model or link.fleet.get("role") != role:
        raise RegistrationError(
            f"the fleet token belongs to a {link.fleet.get('role')} fleet of {link.fleet.get('model')}, "
            f"but this worker is a {role} worker of {model}"
        )
    state.worker_id = link.worker_id
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    data = f", KV data port {receiver.host}:{receiver.port}" if receiver else ""
    log.info(
        "%s worker %s serving %s on %s%s; %d KV blocks of %d tokens on %s",
        role,
        link.worker_id,
        model,
        address,
        data,
        engine.kv.num_blocks,
        engine.kv.block_size,
        engine_config.device,
    )

    tasks = [asyncio.create_task(link.heartbeat_forever()), asyncio.create_task(engine.run())]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()

    link.draining = True
    service.set_draining(True)
    try:
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            await link.heartbeat()
        except httpx.HTTPError as error:
            log.warning("could not tell the control plane this worker drains: %s", error)
        await server.stop(DRAIN_GRACE_S)
    finally:
        for task in tasks:
            task.cancel()
        await link.close()
        if engine.connector is not None:
            engine.connector.close()  # closes the data port, removes shared-memory files
        executor.shutdown(wait=False)
