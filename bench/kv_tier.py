"""The shared KV tier against recomputation, side by side in one run, with a real store process
(`diptych kv-tier`) and engines in this process that reach it over gRPC:

1. Time to first token of a prompt whose first 90% another worker computed: one engine fetches that
   prefix from the tier, another (no tier) recomputes it; the same prompts, alternating which goes first.
2. Prefix hit rates under a multi-turn workload: conversations that grow turn by turn (each turn's prompt
   is the last prompt, its reply and a new message), more of them than one worker's KV pool holds, each turn
   sent to one of two workers at random (as a router without affinity would); once with the tier, once without.

    .venv/bin/python -m bench.kv_tier                       # TTFT on diptych-100m, turns on diptych-tiny
    .venv/bin/python -m bench.kv_tier --ttft-model diptych-tiny
"""

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diptych_common.worker_credential import WorkerSecret
from diptych_server.stack import free_port
from workers.engine.core import Engine, EngineConfig
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.kv_connector.tier import TierConnector
from workers.kv_tier.blocks import tier_namespace
from workers.kv_tier.client import TierClient
from workers.main import build_engine
from workers.runner.model_loader import LoadedModel, load_model

SECRET = "bench-kv-tier-secret"


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Store:
    """The store process, on a free loopback port, holding this run's worker secret."""

    def __init__(self, memory_mib: int) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diptych_server.cli",
                "kv-tier",
                "--port",
                self.address.split(":")[1],
                "--memory-mib",
                str(memory_mib),
            ],
            env={**os.environ, "DIPTYCH_WORKER_RPC_SECRET": SECRET},
            stderr=subprocess.DEVNULL,
        )

    def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit("the KV tier's store process stopped at start")
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == 1:
                        return
                except grpc.RpcError:
                    time.sleep(0.1)
        raise SystemExit("the KV tier's store process did not serve in time")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def engine_for(loaded: LoadedModel, executor, num_blocks: int, tier_address: str | None) -> Engine:
    engine = build_engine(loaded, EngineConfig(num_kv_blocks=num_blocks, cuda_graphs=False), executor)
    if tier_address is not None:
        layout = engine.runner.layout
        namespace = tier_namespace(loaded.name, layout)
        client = TierClient(tier_address, namespace, layout.block_nbytes, WorkerSecret(SECRET))
        engine.attach_connector(TierConnector(client, engine.kv, engine.runner, executor))
    return engine


def tier_of(engine: Engine) -> TierConnector | None:
    return engine.connector if isinstance(engine.connector, TierConnector) else None


@dataclass
class Served:
    tokens: list[int]
    first_token_s: float  # the tier fetch included
    fetch_s: float


async def serve(engine: Engine, request_id: str, prompt: list[int], max_tokens: int) -> Served:
    started = time.perf_counter()
    request = EngineRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    await engine.connector.prepare(request)
    fetch_s = time.perf_counter() - started
    handle = engine.add(request)
    tokens: list[int] = []
    first_s = 0.0
    while True:
        output = await handle.outputs.get()
        if isinstance(output, Exception):
            raise output
        if not tokens:
            first_s = time.perf_counter() - started
        tokens.append(output.token_id)
        if output.finished:
            return Served(tokens, first_s, fetch_s)


async def shipped(engine: Engine) -> None:
    tier = tier_of(engine)
    if tier is not None and not await tier.flush(30.0):
        raise SystemExit("the tier did not take the blocks in time")


# ---- 1. time to first token ------------------------------------------------------------------------------


async def ttft(loaded: LoadedModel, address: str, prompt_tokens: int, samples: int) -> None:
    shared_tokens = int(prompt_tokens * 0.9)
    vocab = loaded.model.config.vocab_size
    rng = random.Random(7)
    num_blocks = 4 * (prompt_tokens // 16 + 2)
    with ThreadPoolExecutor(max_workers=1) as executor:
        computer = engine_for(loaded, executor, num_blocks, address)  # the worker that computed the prefix
        fetcher = engine_for(loaded, executor, num_blocks, address)
        recomputer = engine_for(loaded, executor, num_blocks, None)
        tasks = [asyncio.create_task(engine.run()) for engine in (computer, fetcher, recomputer)]
        for engine in (fetcher, recomputer):  # first steps are slower: warm each engine up once
            await serve(engine, "warm", [rng.randrange(3, vocab) for _ in range(prompt_tokens)], 1)
        fetched: list[float] = []
        recomputed: list[float] = []
        fetches: list[float] = []
        equal = 0
        for sample in range(samples):
            shared = [rng.randrange(3, vocab) for _ in range(shared_tokens)]
            tail = [rng.randrange(3, vocab) for _ in range(prompt_tokens - shared_tokens)]
            await serve(computer, f"c{sample}", shared + [rng.randrange(3, vocab) for _ in tail], 1)
            await shipped(computer)
            order = [(fetcher, fetched), (recomputer, recomputed)]
            firsts = []
            for engine, times in order if sample % 2 == 0 else order[::-1]:
                served = await serve(engine, f"s{sample}", shared + tail, 1)
                times.append(served.first_token_s)
                firsts.append(served.tokens[0])
                if engine is fetcher:
                    fetches.append(served.fetch_s)
            equal += firsts[0] == firsts[1]
            progress(f"  sample {sample + 1}/{samples}: tier {fetched[-1]:.3f} s, recomputed {recomputed[-1]:.3f} s")
        stats = fetcher.stats()
        block_nbytes = fetcher.runner.layout.block_nbytes
        for task in tasks:
            task.cancel()
        for engine in (computer, fetcher):
            await engine.connector.close()
    tier_p50, plain_p50 = statistics.median(fetched), statistics.median(recomputed)
    print(
        f"TTFT, {loaded.name}, prompts of {prompt_tokens} tokens whose first {shared_tokens} another worker "
        f"computed, {samples} samples:"
    )
    print(
        f"  fetched from the tier: p50 {tier_p50 * 1000:.1f} ms   recomputed: p50 {plain_p50 * 1000:.1f} ms   "
        f"ratio {plain_p50 / tier_p50:.2f}x faster"
    )
    fetched_tokens = stats.tier.hit_tokens // samples
    fetched_mib = fetched_tokens // 16 * block_nbytes / (1 << 20)
    print(
        f"  of the tier's TTFT, the fetch: p50 {statistics.median(fetches) * 1000:.1f} ms ({fetched_tokens} tokens, "
        f"{fetched_mib:.1f} MiB a prompt); first tokens equal {equal}/{samples}"
    )


# ---- 2. multi-turn hit rates --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turns:
    conversations: int
    turns: int
    first_tokens: int  # the first message
    message_tokens: int  # each later message
    reply_tokens: int
    pool_blocks: int  # each worker's KV pool
    per_worker: int  # requests at once on a worker


async def multi_turn(loaded: LoadedModel, address: str | None, spec: Turns) -> dict[str, float]:
    vocab = loaded.model.config.vocab_size
    rng = random.Random(11)
    histories = [[rng.randrange(3, vocab) for _ in range(spec.first_tokens)] for _ in range(spec.conversations)]
    with ThreadPoolExecutor(max_workers=1) as executor:
        workers = [engine_for(loaded, executor, spec.pool_blocks, address) for _ in range(2)]
        tasks = [asyncio.create_task(engine.run()) for engine in workers]
        slots = [asyncio.Semaphore(spec.per_worker) for _ in workers]

        async def turn(conversation: int, number: int) -> None:
            worker = random.Random(conversation * 1000 + number).randrange(2)  # the same routing in both runs
            async with slots[worker]:
                prompt = histories[conversation]
                reply = (await serve(workers[worker], f"c{conversation}t{number}", prompt, spec.reply_tokens)).tokens
                await shipped(workers[worker])
            message = [rng.randrange(3, vocab) for _ in range(spec.message_tokens)]
            histories[conversation] = prompt + reply + message

        for number in range(spec.turns):
            await asyncio.gather(*(turn(c, number) for c in range(spec.conversations)))
        stats = [engine.stats() for engine in workers]
        for task in tasks:
            task.cancel()
        for engine in workers:
            await engine.connector.close()
    queried = sum(s.prefix_cache_queried_tokens for s in stats)
    return {
        "local": sum(s.prefix_cache_hit_tokens for s in stats) / queried,
        "tier": sum(s.tier.hit_tokens for s in stats) / queried,
        "computed": sum(s.prompt_tokens_computed for s in stats),
        "queried": queried,
        "errors": sum(s.tier.errors + s.tier.blocks_dropped for s in stats),
    }


async def turns(loaded: LoadedModel, address: str, spec: Turns) -> None:
    results: dict[str, dict[str, float]] = {}
    for label, tier_address in (("without the tier", None), ("with the tier", address)):
        progress(f"  multi-turn {label} ...")
        results[label] = await multi_turn(loaded, tier_address, spec)
    final = spec.first_tokens + (spec.turns - 1) * (spec.reply_tokens + spec.message_tokens)
    print(
        f"multi-turn, {loaded.name}: {spec.conversations} conversations x {spec.turns} turns (up to {final} tokens "
        f"each), each turn on one of 2 workers at random, {spec.pool_blocks} KV blocks of 16 tokens per worker:"
    )
    for label, result in results.items():
        local, tier = result["local"], result["tier"]
        print(
            f"  {label:<17} prefix hits: local {local:6.1%}  tier {tier:6.1%}  total {local + tier:6.1%}   "
            f"prompt tokens computed {int(result['computed'])} of {int(result['queried'])}"
            + (f"   (tier errors and dropped blocks: {int(result['errors'])})" if tier else "")
        )
    without, with_tier = results["without the tier"], results["with the tier"]
    print(f"  prompt tokens computed, without / with the tier: {without['computed'] / with_tier['computed']:.2f}x")


async def main(args) -> None:
    torch.set_num_threads(args.threads)
    store = Store(args.store_mib)
    try:
        store.wait_serving()
        progress(f"loading {args.ttft_model} ...")
        loaded = load_model(args.ttft_model, f"builtin:{args.ttft_model}")
        await ttft(loaded, store.address, args.prompt_tokens, args.samples)
        spec = Turns(args.conversations, args.turns, 96, 48, 16, args.pool_blocks, 2)
        await turns(load_model("diptych-tiny", "builtin:diptych-tiny"), store.address, spec)
    finally:
        store.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_tier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttft-model", default="diptych-100m", choices=["diptych-tiny", "diptych-100m"])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--pool-blocks", type=int, default=96, help="each multi-turn worker's KV pool")
    parser.add_argument("--store-mib", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
