"""Runs the gateway process: the public Inference API on gRPC (with health checking and reflection) and
the OpenAI-compatible HTTP API, in one event loop, sharing one pipeline.

SIGTERM or SIGINT drains: health turns NOT_SERVING, new requests are refused, in-flight streams run to
their end (up to DRAIN_GRACE_S), usage is flushed (or spooled), then the process exits.
"""

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from diptych_common.artifacts import ArtifactCache, fetch_tokenizer_files
from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from gateway.accounts.auth import Authenticator
from gateway.accounts.control_plane_http import AiohttpTransport
from gateway.accounts.idempotency import IdempotencyKeys
from gateway.accounts.limits import RateLimiter
from gateway.accounts.refusals import RefusalReporter
from gateway.accounts.usage import Reporter, UsageJournal, UsageReporter
from gateway.autoscale.decision import ScalingPolicy
from gateway.autoscale.signals import AutoscaleSignals, SloTargets
from gateway.core.pipeline import Pipeline
from gateway.core.request_path import RequestPath, Timeouts
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry
from gateway.grpc_api.service import SERVICE_NAME, add_inference_service
from gateway.openai_api.app import build_app
from gateway.openai_api.batches import BatchApiProxy
from gateway.openai_api.responses_store import ResponseStore
from gateway.openai_api.server import JsonErrorAppRunner
from gateway.routing.policies import DEFAULT_POLICY, POLICIES
from gateway.routing.route import ServingMode
from gateway.routing.router import Router

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0
STARTUP_RETRY_S = 0.5


@dataclass(frozen=True)
class GatewayConfig:
    host: str
    port: int
    http_port: int
    metrics_port: int
    control_plane_url: str
    internal_token: str
    mode: ServingMode
    state_dir: Path
    region: str = ""
    redis_url: str | None = None
    skip_split_below: int = 0
    prefill_overflow_tokens: int = 0
    routing_policy: str = DEFAULT_POLICY  # a name in gateway.routing.policies.POLICIES
    timeouts: Timeouts = field(default_factory=Timeouts)
    slo: SloTargets = field(default_factory=SloTargets)  # the autoscaling signals' TTFT and TPOT targets
    autoscale_policy: ScalingPolicy = field(default_factory=ScalingPolicy)


async def serve(config: GatewayConfig) -> None:
    start_http_server(config.metrics_port, addr=config.host)
    control_plane = ControlPlaneClient(config.control_plane_url, config.internal_token, transport=AiohttpTransport())
    channels = Channels()
    await _fetch_worker_secret(control_plane, channels)
    board = LoadBoard(channels)
    artifacts = ArtifactCache(config.state_dir / "artifact-cache")  # not "artifacts": the embedded store lives there
    registry = Registry(
        control_plane,
        on_refresh=board.sync,
        is_alive=board.is_fresh,
        tokenizer_files=lambda model: fetch_tokenizer_files(
            config.control_plane_url, config.internal_token, model, artifacts
        ),
    )
    await _first_refresh(registry)
    journal = UsageJournal(config.state_dir / f"gateway-{config.port}-usage-spool.sqlite3")
    recovered = journal.recover()
    if recovered:
        log.warning("billed %d executions that a previous run of this gateway left unfinished", len(recovered))
    usage = UsageReporter(control_plane, journal)
    idempotency = IdempotencyKeys(control_plane, journal)
    held_by_a_killed_run = idempotency.held_by_a_previous_run()
    if held_by_a_killed_run:
        log.warning("settling %d idempotency keys that a previous run of this gateway held", len(held_by_a_killed_run))
    limiter = RateLimiter(config.redis_url)
    refusals = RefusalReporter(control_plane, limiter.refusals)
    router = Router(
        registry,
        board,
        config.mode,
        config.region,
        config.skip_split_below,
        config.prefill_overflow_tokens,
        POLICIES[config.routing_policy](),
    )
    path = RequestPath(channels, board, router, config.timeouts)
    pipeline = Pipeline(Authenticator(control_plane), registry, limiter, path, journal, idempotency)

    server = grpc.aio.server()
    add_inference_service(server, pipeline)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound_port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    batch_api = BatchApiProxy(config.control_plane_url)
    app = build_app(pipeline, batch_api, ResponseStore(control_plane))
    http_runner = JsonErrorAppRunner(app, handler_cancellation=True, access_log=None)
    await http_runner.setup()
    http_site = web.TCPSite(http_runner, config.host, config.http_port)
    await http_site.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "gateway serving gRPC on %s:%d and HTTP on %s:%d (%s mode, region %r, rate limits %s, usage spool %s)",
        config.host,
        bound_port,
        config.host,
        config.http_port,
        config.mode,
        config.region,
        limiter.backend,
        journal.count(),
    )

    autoscale = AutoscaleSignals(registry, board, config.autoscale_policy, config.slo)
    tasks = [
        asyncio.create_task(registry.refresh_forever()),
        asyncio.create_task(usage.flush_forever()),
        asyncio.create_task(refusals.flush_forever()),
        asyncio.create_task(autoscale.publish_forever()),
        asyncio.create_task(idempotency.settle_held(held_by_a_killed_run, recovered)),
    ]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()

    log.info("draining: finishing %d in-flight streams, taking no new ones", pipeline.in_flight)
    pipeline.draining = True
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await http_site.stop()  # no new HTTP connections
    await asyncio.gather(server.stop(DRAIN_GRACE_S), _wait_idle(pipeline, DRAIN_GRACE_S))
    await http_runner.cleanup()
    await batch_api.close()
    for task in tasks:
        task.cancel()
    await idempotency.wait_idle(5.0)
    await _last_flush(usage)
    await _last_flush(refusals)
    board.close()
    await limiter.close()
    await channels.close()
    await control_plane.close()
    journal.close()
    log.info("gateway stopped")


async def _wait_idle(pipeline: Pipeline, grace_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + grace_s
    while pipeline.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


async def _last_flush(reporter: Reporter) -> None:
    try:
        await asyncio.wait_for(reporter.flush(), 5.0)
    except Exception as error:
        log.warning("control plane unreachable at shutdown; %d reports not sent: %r", reporter.pending, error)


async def _fetch_worker_secret(control_plane: ControlPlaneClient, channels: Channels) -> None:
    """The worker RPC secret, before any call to a worker: workers refuse calls without it."""
    while True:
        try:
            channels.secret.set(await control_plane.worker_rpc_secret())
            return
        except (ControlPlaneUnavailable, httpx.HTTPError, KeyError, ValueError) as error:
            log.info("waiting for the control plane to hand over the worker RPC secret: %r", error)
            await asyncio.sleep(STARTUP_RETRY_S)


async def _first_refresh(registry: Registry) -> None:
    while True:
        try:
            await registry.refresh()
            return
        except Exception as error:
            log.info("waiting for the control plane: %r", error)
            await asyncio.sleep(STARTUP_RETRY_S)
