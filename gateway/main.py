"""Runs the gateway process: the public Inference API on gRPC, with health checking and reflection."""

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from diptych._proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.auth import Authenticator
from gateway.control_plane import ControlPlaneClient
from gateway.registry import Registry
from gateway.request_path import RequestPath
from gateway.routing import Router, ServingMode
from gateway.service import InferenceService
from gateway.usage import UsageReporter

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0
STARTUP_RETRY_S = 0.5


async def serve(
    *, host: str, port: int, metrics_port: int, control_plane_url: str, internal_token: str, mode: ServingMode
) -> None:
    start_http_server(metrics_port, addr=host)
    control_plane = ControlPlaneClient(control_plane_url, internal_token)
    registry = Registry(control_plane)
    await _first_refresh(registry)
    usage = UsageReporter(control_plane)
    path = RequestPath()
    service = InferenceService(Authenticator(control_plane), registry, Router(registry, mode), path, usage)

    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name, reflection.SERVICE_NAME), server
    )
    bound_port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("gateway serving on %s:%d (%s mode)", host, bound_port, mode)

    tasks = [asyncio.create_task(registry.refresh_forever()), asyncio.create_task(usage.flush_forever())]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()

    log.info("draining: finishing in-flight streams, taking no new ones")
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(DRAIN_GRACE_S)
    for task in tasks:
        task.cancel()
    try:
        await usage.flush()
    except Exception as error:
        log.error("could not send %d usage events before stopping: %r", usage.pending, error)
    await path.close()
    await control_plane.close()


async def _first_refresh(registry: Registry) -> None:
    while True:
        try:
            await registry.refresh()
            return
        except Exception as error:
            log.info("waiting for the control plane: %r", error)
            await asyncio.sleep(STARTUP_RETRY_S)
