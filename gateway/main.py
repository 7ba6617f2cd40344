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
from gateway.accounts.usage import HeldKey, Recovered, Reporter, UsageJournal, UsageReporter
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
    parts = await _assemble(config)
    servers = await _start_servers(config, parts)
    tasks = _start_background(config, parts)
    await _until_signalled()
    await _drain(parts, servers, tasks)
    log.info("gateway stopped")


@dataclass
class _Parts:
    """What a gateway process holds, built in order: each part takes some of those before it."""

    control_plane: ControlPlaneClient
    channels: Channels
    board: LoadBoard
    registry: Registry
    journal: UsageJournal
    usage: UsageReporter
    idempotency: IdempotencyKeys
    limiter: RateLimiter
    refusals: RefusalReporter
    pipeline: Pipeline
    recovered: list[Recovered]  # executions a killed run left unfinished, billed as the process starts
    held_by_a_killed_run: list[HeldKey]


async def _assemble(config: GatewayConfig) -> _Parts:
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
    idempotency = IdempotencyKeys(control_plane, journal)
    held = idempotency.held_by_a_previous_run()
    if held:
        log.warning("settling %d idempotency keys that a previous run of this gateway held", len(held))
    limiter = RateLimiter(config.redis_url)
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
    return _Parts(
        control_plane=control_plane,
        channels=channels,
        board=board,
        registry=registry,
        journal=journal,
        usage=UsageReporter(control_plane, journal),
        idempotency=idempotency,
        limiter=limiter,
        refusals=RefusalReporter(control_plane, limiter.refusals),
        pipeline=Pipeline(Authenticator(control_plane), registry, limiter, path, journal, idempotency),
        recovered=recovered,
        held_by_a_killed_run=held,
    )


@dataclass
class _Servers:
    grpc: grpc.aio.Server
    health: health.aio.HealthServicer
    http_runner: JsonErrorAppRunner
    http_site: web.TCPSite
    batch_api: BatchApiProxy


async def _start_servers(config: GatewayConfig, parts: _Parts) -> _Servers:
    """The gRPC and HTTP servers, serving once both listen."""
    server = grpc.aio.server()
    add_inference_service(server, parts.pipeline)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound_port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    batch_api = BatchApiProxy(config.control_plane_url)
    app = build_app(parts.pipeline, batch_api, ResponseStore(parts.control_plane))
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
        parts.limiter.backend,
        parts.journal.count(),
    )
    return _Servers(server, health_servicer, http_runner, http_site, batch_api)


def _start_background(config: GatewayConfig, parts: _Parts) -> list[asyncio.Task[None]]:
    autoscale = AutoscaleSignals(parts.registry, parts.board, config.autoscale_policy, config.slo)
    return [
        asyncio.create_task(parts.registry.refresh_forever()),
        asyncio.create_task(parts.usage.flush_forever()),
        asyncio.create_task(parts.refusals.flush_forever()),
        asyncio.create_task(autoscale.publish_forever()),
        asyncio.create_task(parts.idempotency.settle_held(parts.held_by_a_killed_run, parts.recovered)),
    ]


async def _until_signalled() -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()


async def _drain(parts: _Parts, servers: _Servers, tasks: list[asyncio.Task[None]]) -> None:
    """Finishes the streams in flight, taking no new ones, then flushes usage and closes the parts."""
    log.info("draining: finishing %d in-flight streams, taking no new ones", parts.pipeline.in_flight)
    parts.pipeline.draining = True
    await servers.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await servers.http_site.stop()  # no new HTTP connections
    await asyncio.gather(servers.grpc.stop(DRAIN_GRACE_S), _wait_idle(parts.pipeline, DRAIN_GRACE_S))
    await servers.http_runner.cleanup()
    await servers.batch_api.close()
    for task in tasks:
        task.cancel()
    await parts.idempotency.wait_idle(5.0)
    await _last_flush(parts.usage)
    await _last_flush(parts.refusals)
    parts.board.close()
    await parts.limiter.close()
    await parts.channels.close()
    await parts.control_plane.close()
    parts.journal.close()


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
