"""Runs one worker process: loads the model, serves the worker gRPC API and stays registered."""

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diptych_common.proto.v1 import worker_pb2_grpc
from workers.decode_engine import DecodeEngine
from workers.kv_transfer import KvInbox, KvSender
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.prefill_engine import PrefillEngine
from workers.registration import ControlPlaneLink, RegistrationError
from workers.sampling import StopCriteria
from workers.server import Role, WorkerService, WorkerState

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0
MAX_MESSAGE_BYTES = 64 << 20


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
) -> None:
    torch.set_num_threads(threads)
    loaded = load_model(model, model_source)
    runner = ModelRunner(loaded)
    stop = StopCriteria(loaded.eos_token_ids, loaded.context_length)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    state = WorkerState(role=role)
    prefill = PrefillEngine(runner, executor) if role in (Role.PREFILL, Role.COLOCATED) else None
    decode = DecodeEngine(runner, executor, stop) if role in (Role.DECODE, Role.COLOCATED) else None
    inbox = KvInbox() if role is Role.DECODE else None
    sender = KvSender() if role is Role.PREFILL else None
    service = WorkerService(state, stop, prefill=prefill, decode=decode, inbox=inbox, sender=sender)

    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    address = f"{host}:{bound_port}"

    link = ControlPlaneLink(control_plane_url, fleet_token, address, name, service.load_report)
    await link.register_until_accepted()
    if link.fleet.get("model") != model or link.fleet.get("role") != role:
        raise RegistrationError(
            f"the fleet token belongs to a {link.fleet.get('role')} fleet of {link.fleet.get('model')}, "
            f"but this worker is a {role} worker of {model}"
        )
    state.worker_id = link.worker_id
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("%s worker %s serving %s on %s", role, link.worker_id, model, address)

    tasks = [asyncio.create_task(link.heartbeat_forever())]
    tasks += [asyncio.create_task(engine.run()) for engine in (prefill, decode) if engine is not None]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()

    log.info("draining: finishing in-flight requests, taking no new ones")
    link.draining = True
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await link.heartbeat()
    await server.stop(DRAIN_GRACE_S)
    for task in tasks:
        task.cancel()
    await link.close()
    if sender is not None:
        await sender.close()
    executor.shutdown(wait=False)

