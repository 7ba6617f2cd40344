"""Runs one worker process: loads the model, serves the worker gRPC API (and, on decode workers, the
KV data port) and stays registered."""

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import httpx
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diptych_common.artifacts import ArtifactCache, model_for_worker
from diptych_common.credential_server import worker_server
from diptych_common.grammar import llguidance_tokenizer
from diptych_common.logs import describe_error
from diptych_common.proto.v1 import worker_pb2_grpc
from diptych_common.worker_credential import WorkerSecret
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.kv_connector.shm import sweep_stale_files
from workers.models.sharding import check_shardable
from workers.runner.decode_graphs import DecodeGraphSpec
from workers.runner.kv_pool import kv_layout_of
from workers.runner.model_loader import LoadedModel, load_model
from workers.runner.model_runner import ModelRunner
from workers.runner.tensor_parallel import TensorParallelRunner, TensorParallelSpec, launch
from workers.serving.config import WorkerConfig
from workers.serving.kv_hand_off import build_connector
from workers.serving.metrics import serve_metrics
from workers.serving.registration import ControlPlaneLink, RegistrationError
from workers.serving.server import Role, WorkerService, WorkerState
from workers.structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0
DEFAULT_MODEL = "diptych-tiny"  # what an explicit --model-source serves when no --model names it
MAX_MESSAGE_BYTES = 64 << 20
FOLLOWER_DIED_EXIT_CODE = 3


@dataclass(frozen=True)
class TensorParallelLaunch:
    """How `build_engine` starts a tensor-parallel group: its degree, where the followers load the model
    from, and what to do when the group is lost (a follower died, or an operation failed on rank 0)."""

    degree: int
    model_source: str
    on_group_lost: Callable[[str], None] | None = None


def stop_on_group_lost(why: str) -> None:
    """A rank is gone, or the ranks are out of step, and the group cannot step again: the worker exits at
    once (its calls fail with UNAVAILABLE, and the gateway retries elsewhere) rather than hang in its next
    collective or fail every step."""
    log.critical("%s; this worker stops", why)
    logging.shutdown()
    os._exit(FOLLOWER_DIED_EXIT_CODE)


def build_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    executor: ThreadPoolExecutor,
    tensor_parallel: TensorParallelLaunch | None = None,
) -> Engine:
    """The model runner and engine for a loaded model; the KV pool takes `config.kv_cache_mib` (on each
    rank, under tensor parallelism: a rank's pool holds its kv heads, so there are more blocks)."""
    degree = tensor_parallel.degree if tensor_parallel else 1
    check_shardable(loaded.model.config, degree)
    dtype = next(loaded.model.parameters()).dtype
    layout = kv_layout_of(loaded.model.config, config.block_size, dtype)
    num_blocks = config.num_kv_blocks or max(1, (config.kv_cache_mib << 20) // (layout.block_nbytes // degree))
    runner: ModelRunner
    if tensor_parallel is not None and degree > 1:
        spec = TensorParallelSpec(
            degree,
            loaded.name,
            tensor_parallel.model_source,
            str(dtype).removeprefix("torch."),
            config.device,
            num_blocks,
            config.block_size,
            threads=torch.get_num_threads(),
        )
        if config.cuda_graphs and config.device.startswith("cuda"):
            log.info("a tensor-parallel worker runs its decode steps eagerly: no CUDA graphs are captured")
        runner = launch(loaded.model, spec, tensor_parallel.on_group_lost)
    else:
        # PreTrainedModel.to is functools.wraps(nn.Module.to), which typeshed types as a callable that binds no self.
        model = loaded.model.to(config.device)  # type: ignore[arg-type]
        max_blocks = min(num_blocks, -(-loaded.context_length // config.block_size))
        every_step = DecodeGraphSpec(config.max_running, max_blocks, max_tokens=config.token_budget)
        graphs = every_step if config.cuda_graphs else None
        runner = ModelRunner(
            model, num_blocks, config.block_size, config.device, decode_graphs=graphs, attention=config.attention
        )
    stop = StopCriteria(loaded.eos_token_ids, loaded.context_length)
    return Engine(runner, replace(config, num_kv_blocks=num_blocks), stop, executor)


async def serve(config: WorkerConfig) -> None:
    """Loads the model, serves until SIGTERM or SIGINT, then drains: the control plane and the gateway
    learn it first, the calls in flight get DRAIN_GRACE_S to end."""
    torch.set_num_threads(config.threads)
    if swept := sweep_stale_files():
        log.info("removed %d shared-memory files left by workers that no longer run", swept)
    resolved = await asyncio.to_thread(
        model_for_worker,
        config.model,
        config.model_source,
        config.control_plane_url,
        config.fleet_token,
        ArtifactCache(config.artifact_cache),
        DEFAULT_MODEL,
    )
    loaded = load_model(resolved.model, resolved.source, dtype=torch.bfloat16 if config.cuda else torch.float32)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    parallel = TensorParallelLaunch(config.tensor_parallel, resolved.source, stop_on_group_lost)
    engine = build_engine(loaded, config.engine, executor, parallel if config.tensor_parallel > 1 else None)

    state = WorkerState(role=config.role)
    secret = WorkerSecret()  # every call is refused until registration hands it over
    connector, receiver = build_connector(config, resolved.model, engine, secret, executor)
    engine.attach_connector(connector)
    grammars = GrammarCompiler(
        llguidance_tokenizer(loaded.tokenizer, loaded.model.config.vocab_size, loaded.eos_token_ids)
    )
    service = WorkerService(state, engine, secret=secret, grammars=grammars)
    serve_metrics(config.metrics_port, config.host, config.role.value, lambda: service.load().to_proto(), engine)
    server, health_servicer, address = await _start_server(config, service, secret)
    link = ControlPlaneLink(
        config.control_plane_url,
        config.fleet_token,
        address,
        config.name,
        service.load_report,
        on_state=lambda _: service.set_draining(link.draining),
        secret=secret,
        revision=resolved.revision,
    )
    await _register(link, config.role, resolved.model)
    state.worker_id = link.worker_id
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    data = f", KV data port {receiver.host}:{receiver.port}" if receiver else ""
    log.info(
        "%s worker %s serving %s on %s%s; %d KV blocks of %d tokens on %s",
        config.role,
        link.worker_id,
        resolved.model,
        address,
        data,
        engine.kv.num_blocks,
        engine.kv.block_size,
        config.engine.device,
    )
    tasks = [asyncio.create_task(link.heartbeat_forever()), asyncio.create_task(engine.run())]
    try:
        await _until_stopped()
        await _drain(link, service, health_servicer, server)
    finally:
        for task in tasks:
            task.cancel()
        await link.close()
        await engine.connector.close()  # closes the data port and the tier's client, removes shm files
        executor.shutdown(wait=False)
        if isinstance(engine.runner, TensorParallelRunner):
            engine.runner.close()  # the followers leave their loops and exit


async def _start_server(
    config: WorkerConfig, service: WorkerService, secret: WorkerSecret
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
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
    bound_port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    return server, health_servicer, f"{config.host}:{bound_port}"


async def _register(link: ControlPlaneLink, role: Role, model: str) -> None:
    await link.register_until_accepted()
    if link.fleet.get("model") != model or link.fleet.get("role") != role:
        raise RegistrationError(
            f"the fleet token belongs to a {link.fleet.get('role')} fleet of {link.fleet.get('model')}, "
            f"but this worker is a {role} worker of {model}"
        )


async def _until_stopped() -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()


async def _drain(
    link: ControlPlaneLink, service: WorkerService, health_servicer: health.aio.HealthServicer, server: grpc.aio.Server
) -> None:
    link.draining = True
    service.set_draining(True)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await link.heartbeat()
    except httpx.HTTPError as error:
        log.warning("could not tell the control plane this worker drains: %s", describe_error(error))
    await server.stop(DRAIN_GRACE_S)
