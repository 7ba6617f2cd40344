"""The KV tier's store process: one TierStore (host memory spilling to disk) served to a model's workers.

    python -m workers.kv_tier.server --host 127.0.0.1 --port 7070 --memory-mib 1024 \\
        --disk-dir /var/cache/diptych-kv --disk-mib 8192

It serves gRPC (proto/diptych/internal/v1/kv_tier.proto) behind the same credential as the workers: every
call but the health service's must carry the worker RPC secret. The process takes the secret from
DIPTYCH_WORKER_RPC_SECRET or, without it, from the control plane's internal API (DIPTYCH_INTERNAL_TOKEN),
as the gateway does; until it holds one it refuses every call.
"""

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diptych_common.credential_server import worker_server
from diptych_common.internal_api.client import ControlPlaneClient
from diptych_common.logs import configure_logging
from diptych_common.proto.v1 import kv_tier_pb2, kv_tier_pb2_grpc
from diptych_common.worker_credential import WorkerSecret
from workers.kv_tier.client import CHANNEL_OPTIONS
from workers.kv_tier.options import add_tier_arguments, tier_arguments_problem
from workers.kv_tier.store import TierKey, TierStore

log = logging.getLogger(__name__)

MAX_NAMESPACE_CHARS = 512
MAX_KEYS_PER_CALL = 65536
MAX_BLOCK_BYTES = 16 << 20
MAX_REPLY_BYTES = 32 << 20
SECRET_RETRY_S = 1.0


class KvTierService(kv_tier_pb2_grpc.KvTierServicer):
    def __init__(self, store: TierStore) -> None:
        self.store = store

    async def Put(
        self,
        request: kv_tier_pb2.TierPutRequest,
        context: grpc.aio.ServicerContext[kv_tier_pb2.TierPutRequest, kv_tier_pb2.TierPutReply],
    ) -> kv_tier_pb2.TierPutReply:
        await _check_namespace(request.namespace, context)
        await _check_count(len(request.blocks), context)
        for block in request.blocks:
            if not 0 < len(block.data) <= MAX_BLOCK_BYTES:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block {block.block_hash:016x} holds {len(block.data)} bytes; a block holds 1 to "
                    f"{MAX_BLOCK_BYTES} bytes",
                )
        try:
            stored = await asyncio.to_thread(self._put, request)
        except ValueError as error:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{error}: the block was damaged on the way")
        return kv_tier_pb2.TierPutReply(stored=stored)

    async def Lookup(
        self,
        request: kv_tier_pb2.TierKeys,
        context: grpc.aio.ServicerContext[kv_tier_pb2.TierKeys, kv_tier_pb2.TierLookupReply],
    ) -> kv_tier_pb2.TierLookupReply:
        keys = await _keys(request, context)
        return kv_tier_pb2.TierLookupReply(present=await asyncio.to_thread(self.store.present, keys))

    async def Get(
        self,
        request: kv_tier_pb2.TierGetRequest,
        context: grpc.aio.ServicerContext[kv_tier_pb2.TierGetRequest, kv_tier_pb2.TierGetReply],
    ) -> kv_tier_pb2.TierGetReply:
        keys = await _keys(request.keys, context)
        limit = min(request.max_bytes or MAX_REPLY_BYTES, MAX_REPLY_BYTES)
        found = await asyncio.to_thread(self.store.get_run, keys, limit)
        return kv_tier_pb2.TierGetReply(
            blocks=[
                kv_tier_pb2.TierBlock(block_hash=key.block_hash, data=entry.data, checksum=entry.checksum)
                for key, entry in found
            ]
        )

    def _put(self, request: kv_tier_pb2.TierPutRequest) -> int:
        # the checksum is checked by the store, against the bytes as they arrived
        return sum(
            self.store.put(TierKey(request.namespace, block.block_hash), block.data, block.checksum)
            for block in request.blocks
        )


async def _check_namespace(namespace: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if not namespace or len(namespace) > MAX_NAMESPACE_CHARS:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the namespace (model and KV layout) must be 1 to {MAX_NAMESPACE_CHARS} characters",
        )


async def _check_count(count: int, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if count > MAX_KEYS_PER_CALL:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{count} blocks in one call; at most {MAX_KEYS_PER_CALL}"
        )


async def _keys(message: kv_tier_pb2.TierKeys, context: grpc.aio.ServicerContext[Any, Any]) -> list[TierKey]:
    await _check_namespace(message.namespace, context)
    await _check_count(len(message.block_hashes), context)
    return [TierKey(message.namespace, block_hash) for block_hash in message.block_hashes]


# ---- the process --------------------------------------------------------------------------------------


def tier_server(store: TierStore, secret: WorkerSecret) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The store's gRPC server (not started), refusing every call without the worker RPC secret."""
    server = worker_server(secret, options=CHANNEL_OPTIONS)
    kv_tier_pb2_grpc.add_KvTierServicer_to_server(KvTierService(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def serve(args: argparse.Namespace) -> None:
    store = TierStore(args.memory_mib << 20, args.disk_dir, args.disk_mib << 20)
    secret = WorkerSecret(os.environ.get("DIPTYCH_WORKER_RPC_SECRET", ""))
    server, health_servicer = tier_server(store, secret)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    if not secret.known:
        await _secret_from_control_plane(args.control_plane_url, secret)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    disk = f", {args.disk_mib} MiB on disk in {args.disk_dir}" if args.disk_dir and args.disk_mib else ""
    log.info("KV tier serving on %s:%d: %d MiB of memory%s", args.host, port, args.memory_mib, disk)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    await server.stop(1.0)
    stats = store.stats()
    log.info("KV tier stopped: %d hits, %d misses, %d corrupt entries dropped", stats.hits, stats.misses, stats.corrupt)


async def _secret_from_control_plane(control_plane_url: str, secret: WorkerSecret) -> None:
    token = os.environ.get("DIPTYCH_INTERNAL_TOKEN", "")
    if not token:
        raise SystemExit(
            "the KV tier needs the worker RPC secret: set DIPTYCH_WORKER_RPC_SECRET, or DIPTYCH_INTERNAL_TOKEN "
            "for it to ask the control plane"
        )
    async with ControlPlaneClient(control_plane_url, token) as control_plane:
        while True:
            try:
                secret.set(await control_plane.worker_rpc_secret())
                return
            except (httpx.HTTPError, KeyError, ValueError) as error:
                log.info("waiting for the control plane to hand over the worker RPC secret: %r", error)
                await asyncio.sleep(SECRET_RETRY_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.kv_tier.server", description="The shared KV tier's store (host memory and disk)."
    )
    add_tier_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs the store process with parsed options (see workers.kv_tier.options) until SIGTERM or SIGINT."""
    problem = tier_arguments_problem(args)
    if problem is not None:
        print(f"kv-tier: {problem}", file=sys.stderr)
        return 2
    configure_logging()  # text, or JSON lines under DIPTYCH_LOG_FORMAT=json
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
