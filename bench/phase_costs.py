"""Measures what a worker's work costs on this machine and writes it as the planner's cost profile
(`planner.profile`), with the worker's own pieces and settings (those of a default `diptych worker`):

    .venv/bin/python -m bench.phase_costs --model diptych-100m --out planner/profiles/cpu-diptych-100m.json

- prefill: one engine step (the model runner's forward pass and the sampling of its last row) computing one
  prompt of N tokens from its first;
- prefill attention: the same step for chunks that start later in their prompt; the extra time per pair of
  (token computed, earlier token attended to), fitted by least squares;
- decode: one step of B sequences, each one token at context C, over distinct blocks of a KV pool;
- KV transfer: a prompt's blocks staged from a KV pool by the real `KvSender` and acknowledged by the real
  `KvReceiver` in another process, on loopback, by the path workers on one host take (shared memory); a
  line fitted through the times by prompt length;
- overheads outside the engine: a short live run of requests sent one at a time; what their TTFT and TPOT
  took beyond the steps priced above. `--live platform` (the default): the control plane, a colocated worker
  and then a split pair, each with its gateway, on loopback. `--live workers`: no control plane (no Django)
  and no gateway: the same workers served in this process over real gRPC, their KV handed over the real
  data path, the requests sent to them as the gateway sends them (`bench.local_workers`), so the overheads
  leave the gateway's hop out. The GPU run (`bench/gpu_check.sh`) takes this one: the GPU machine has no
  Django.

Progress goes to stderr, the table to stdout, the profile to --out.
"""

import argparse
import asyncio
import multiprocessing
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bench.gateway_client import GatewayClient
from bench.live_platform import start_platform
from bench.local_workers import Worker, split_calls
from bench.progress import log
from bench.stats import RequestResult
from bench.workload import random_tokens
from diptych_common.proto.v1 import worker_pb2
from planner.profile import CostProfile, save_profile
from workers.engine.core import EngineConfig
from workers.engine.kv_transfer import Peer
from workers.engine.sampling import SamplingParams, sample
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.main import build_engine
from workers.models.step import StepInput
from workers.runner.kv_pool import KvLayout
from workers.runner.model_loader import LoadedModel, load_model
from workers.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
TRANSFER_TOKEN = b"phase-costs"
MIN_TIMED_S, MAX_REPEATS = 0.5, 25
KV_REPEATS = 9


@dataclass(frozen=True)
class PointSets:
    """What to measure. Past the model's context, prompt and context lengths are cut to the longest it
    takes, and the chunks and live prompts that would not fit are left out."""

    # dense up to the token budget: a step's cost curves upwards (attention), and lines between far points
    # would overprice the steps between them
    prefill_tokens: tuple[int, ...] = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 1024, 2048)
    attention_chunks: tuple[tuple[int, int], ...] = ((64, 512), (64, 1536), (256, 512), (256, 1536), (512, 1024))
    # a colocated worker's mixed steps, (prompt tokens, decoding sequences, their context): measured to check
    # the profile's pricing of them (`CostProfile.step_s`), not part of it
    mixed_steps: tuple[tuple[int, int, int], ...] = ((64, 4, 256), (128, 8, 256), (256, 16, 512), (480, 32, 512))
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (128, 512, 1024, 2048)
    kv_tokens: tuple[int, ...] = (16, 128, 512, 2048)
    live_prompts: tuple[int, ...] = (48, 128, 384)  # above the split gateway's skip (32 tokens): they split
    live_output_tokens: int = 24
    live_rounds: int = 3  # each live prompt length this many times
    repeats: int = 3

    def within(self, context_length: int) -> "PointSets":
        fits = context_length - 1  # one position is left for the token each step samples
        return replace(
            self,
            prefill_tokens=_cut(self.prefill_tokens, fits),
            attention_chunks=tuple((n, s) for n, s in self.attention_chunks if n + s <= fits),
            mixed_steps=tuple((n, b, c) for n, b, c in self.mixed_steps if max(n, c) < fits),
            decode_contexts=_cut(self.decode_contexts, fits - 1),  # the context before the step's token
            kv_tokens=_cut(self.kv_tokens, fits),
            live_prompts=tuple(n for n in self.live_prompts if n + self.live_output_tokens <= fits),
        )


def _cut(values: tuple[int, ...], longest: int) -> tuple[int, ...]:
    return tuple(sorted({min(value, longest) for value in values}))


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """The median of timed calls of fn, after one untimed call: `repeats` of them, and more of a short call
    until they took MIN_TIMED_S (at most MAX_REPEATS), so that a moment's interference moves no median."""
    fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < MIN_TIMED_S and len(times) < MAX_REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---- engine steps -----------------------------------------------------------------------------------


class StepBench:
    """Engine steps as the forward thread runs them (forward pass, then greedy sampling of the sampled rows)
    on a pool large enough for every point, its memory touched as a pool in use is."""

    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int, device: str = "cpu") -> None:
        self.runner = ModelRunner(loaded.model, num_blocks, block_size, device)
        self.runner.kv.normal_()
        self.block_size = block_size
        self.vocab_size = loaded.model.config.vocab_size

    def time_step(self, inputs: list[StepInput], repeats: int) -> float:
        indices = [0] * sum(step.num_logits for step in inputs)

        def step() -> None:
            logits = self.runner.execute(inputs)
            sample(logits, [GREEDY] * len(indices), indices)

        return median_s(step, repeats)

    def prompt_chunk(self, tokens: int, start: int, first_block: int = 0) -> StepInput:
        blocks = list(range(first_block, first_block + -(-(start + tokens) // self.block_size)))
        token_ids = [6 + (i * 7919) % (self.vocab_size - 6) for i in range(tokens)]
        return StepInput(token_ids, start, blocks, True)

    def decoding(self, batch: int, context: int) -> list[StepInput]:
        per_sequence = context // self.block_size + 1
        return [
            StepInput([6 + row], context, list(range(row * per_sequence, (row + 1) * per_sequence)), True)
            for row in range(batch)
        ]


def measure_prefill(bench: StepBench, points: PointSets) -> list[tuple[int, float]]:
    measured = []
    for tokens in points.prefill_tokens:
        seconds = bench.time_step([bench.prompt_chunk(tokens, 0)], points.repeats)
        log(f"prefill step of {tokens} tokens: {seconds * 1000:.1f} ms")
        measured.append((tokens, seconds))
    return measured


def fit_attention_pair_s(bench: StepBench, points: PointSets, prefill: list[tuple[int, float]]) -> float:
    """The extra seconds per (token computed, earlier token attended to), through the origin: a chunk of n
    tokens starting at s takes prefill(n) + a * n * s."""
    base = dict(prefill)
    pairs, extras = [], []
    for tokens, start in points.attention_chunks:
        if tokens not in base:
            continue
        seconds = bench.time_step([bench.prompt_chunk(tokens, start)], points.repeats)
        log(f"prefill chunk of {tokens} tokens from position {start}: {seconds * 1000:.1f} ms")
        pairs.append(tokens * start)
        extras.append(seconds - base[tokens])
    if not pairs:
        return 0.0
    x, y = np.array(pairs, dtype=float), np.array(extras)
    return max(0.0, float(x @ y / (x @ x)))


@dataclass(frozen=True)
class MixedStep:
    prompt_tokens: int
    batch: int
    context: int
    seconds: float


def measure_mixed(bench: StepBench, points: PointSets) -> list[MixedStep]:
    measured = []
    for tokens, batch, context in points.mixed_steps:
        decoding = bench.decoding(batch, context)
        prompt = bench.prompt_chunk(tokens, 0, first_block=decoding[-1].block_ids[-1] + 1)
        seconds = bench.time_step([*decoding, prompt], points.repeats)
        log(f"mixed step of {tokens} prompt tokens and {batch} sequences at context {context}: {seconds * 1000:.1f} ms")
        measured.append(MixedStep(tokens, batch, context, seconds))
    return measured


def measure_decode(bench: StepBench, points: PointSets) -> list[tuple[int, int, float]]:
    measured = []
    for context in points.decode_contexts:
        for batch in points.decode_batches:
            seconds = bench.time_step(bench.decoding(batch, context), points.repeats)
            log(f"decode step of {batch} sequences at context {context}: {seconds * 1000:.1f} ms")
            measured.append((batch, context, seconds))
    return measured


# ---- KV transfer ------------------------------------------------------------------------------------


def _receiver_process(ready, layout: KvLayout, max_tokens: int, requests: Sequence[tuple[str, int]]) -> None:
    """The decode worker's side: its data port, expecting the benchmark's transfers (id, prompt tokens)."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so the finally below removes the probe file
    inbox = KvInbox()
    for request_id, tokens in requests:
        inbox.expect(request_id, TRANSFER_TOKEN, lambda received: getattr(received, "release", lambda: None)(), tokens)
    receiver = KvReceiver(inbox, layout, max_tokens=max_tokens)
    receiver.start()
    ready.send(receiver.port)
    try:
        threading.Event().wait()
    finally:
        receiver.close()


def measure_kv_transfer(
    layout: KvLayout, points: PointSets, device: str = "cpu"
) -> tuple[float, float, list[tuple[int, float]]]:
    """(fixed seconds, seconds per token, the medians by prompt length): from the first block staged (out of
    a pool on `device`) to the sender holding the receiver's acknowledgement that the whole cache arrived
    and checked out (into host memory)."""
    max_tokens = max(points.kv_tokens)
    repeats = max(points.repeats, KV_REPEATS)  # each takes milliseconds: a steadier median costs little
    ids = [(f"kv-{tokens}-{repeat}", tokens) for tokens in points.kv_tokens for repeat in range(repeats + 1)]
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_receiver_process, args=(theirs, layout, max_tokens, ids), daemon=True)
    process.start()
    sender = KvSender(layout)
    pool = StepPool(layout, -(-max_tokens // layout.block_size), device)
    try:
        port = ours.recv()
        peer = Peer("127.0.0.1", port, same_host=True)
        medians = []
        for tokens in points.kv_tokens:
            times = [
                _one_transfer(sender, pool, peer, f"kv-{tokens}-{repeat}", tokens) for repeat in range(repeats + 1)
            ]
            medians.append((tokens, statistics.median(times[1:])))
            log(f"KV transfer of {tokens} tokens: {medians[-1][1] * 1000:.2f} ms")
    finally:
        sender.close()
        process.terminate()
        process.join(10)
    fixed, per_token = _fit_line([t for t, _ in medians], [s for _, s in medians])
    return fixed, per_token, medians


class StepPool:
    """A KV pool shaped like the model runner's, on its device, filled with random values: what the sender
    stages from (in place from host memory; through the runner's copy out of device memory)."""

    shard = None  # a whole pool: every kv head

    def __init__(self, layout: KvLayout, num_blocks: int, device: str = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
        self.kv = torch.randn(shape, dtype=layout.dtype, device=self.device)

    block_views = ModelRunner.block_views
    pool_memory = ModelRunner.pool_memory
    supports_block_views = ModelRunner.supports_block_views
    read_blocks = ModelRunner.read_blocks
    start_reading_blocks = ModelRunner.start_reading_blocks
    _copy_stream = None


def _one_transfer(sender: KvSender, pool: StepPool, peer: Peer, request_id: str, tokens: int) -> float:
    outgoing = sender.open(request_id, TRANSFER_TOKEN, [7] * tokens, peer)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(outgoing.send()))
    thread.start()
    time.sleep(0.02)  # a worker's transfer connects when its request is taken, while the prompt computes
    started = time.perf_counter()
    outgoing.write_blocks(pool, list(range(outgoing.num_blocks)), 0)
    outgoing.finish(7)
    thread.join()
    elapsed = time.perf_counter() - started
    if result != [outgoing.num_blocks * pool.layout.block_nbytes]:
        raise RuntimeError(f"the KV transfer of {tokens} tokens did not deliver its cache whole")
    return elapsed


def _fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares, neither below zero."""
    if len(xs) == 1:
        return ys[0], 0.0
    slope, intercept = np.polyfit(np.array(xs, dtype=float), np.array(ys), 1)
    slope = max(0.0, float(slope))
    intercept = max(0.0, float(np.mean(ys) - slope * np.mean(xs)))
    return intercept, slope


# ---- overheads outside the engine -------------------------------------------------------------------


LIVE_THROUGH = {
    "platform": "through the gateway (control plane, gateway and workers on loopback)",
    "workers": "to workers in this process (no gateway, no control plane)",
}
LIVE_MODES = tuple(LIVE_THROUGH)
SPLIT_BUSY = "split+busy"  # split, while the decode worker decodes another request: as under load
BUSY_PROMPT_TOKENS = 16  # at most the split gateway's skip (32): the request runs wholly on the decode worker
BUSY_OUTPUT_TOKENS = 64


@dataclass(frozen=True)
class LiveSample:
    mode: str  # colocated, split, or SPLIT_BUSY
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    second_token_s: float  # from the first token to the second (in split mode, the KV hand-off is in it)


class Client(Protocol):
    async def generate(self, prompt_token_ids: list[int], max_tokens: int) -> RequestResult: ...


def measure_live(
    model: str,
    context_length: int,
    threads: int,
    points: PointSets,
    vocab_size: int,
    modes: Sequence[str],
    device: str = "cpu",
) -> list[LiveSample]:
    """Requests one at a time through each mode's gateway and workers (a real platform on loopback, its
    workers on `device`)."""
    samples = []
    with tempfile.TemporaryDirectory(prefix="diptych-phase-costs-") as scratch:
        platform = start_platform(
            Path(scratch) / "stack", model, context_length, threads, threads, log, worker_args=("--device", device)
        )
        try:
            for mode in modes:
                with platform.serving(mode) as address:
                    samples += asyncio.run(_through_gateway(address, platform.api_key, model, mode, points, vocab_size))
        finally:
            platform.stop()
    return samples


async def _through_gateway(
    address: str, api_key: str, model: str, mode: str, points: PointSets, vocab_size: int
) -> list[LiveSample]:
    async with GatewayClient(address, api_key, model) as client:
        samples = await _live_requests(client, None, mode, points, vocab_size)
        if mode == "split":  # the gateway sends the busy load's short prompts to the decode worker whole
            samples += await _live_requests(client, client, SPLIT_BUSY, points, vocab_size)
    return samples


def measure_live_workers(
    loaded: LoadedModel, config: EngineConfig, points: PointSets, modes: Sequence[str]
) -> list[LiveSample]:
    """Requests one at a time to each mode's workers, served in this process (no control plane, no gateway),
    each worker's engine built as `diptych worker` builds it from `config`; one mode's workers at a time."""
    return asyncio.run(_live_workers(loaded, config, points, modes))


async def _live_workers(
    loaded: LoadedModel, config: EngineConfig, points: PointSets, modes: Sequence[str]
) -> list[LiveSample]:
    vocab_size = loaded.model.config.vocab_size
    samples = []
    for mode in modes:
        roles = ("prefill", "decode") if mode == "split" else ("colocated",)
        async with AsyncExitStack() as stack:
            log(f"starting the {mode} worker(s) in this process ({loaded.name} on {config.device})")
            # one forward thread each, as each worker process has: an engine's steps run in order on one thread
            executors = [stack.enter_context(ThreadPoolExecutor(max_workers=1)) for _ in roles]
            workers = [_local_worker(role, loaded, config, ex) for role, ex in zip(roles, executors, strict=True)]
            for worker in workers:
                await worker.start()
                stack.push_async_callback(worker.stop)
            samples += await _live_requests(WorkerCalls(*workers), None, mode, points, vocab_size)
            if mode == "split":  # the busy load decodes on the decode worker alone, as the gateway sends it
                busy = WorkerCalls(workers[1])
                samples += await _live_requests(WorkerCalls(*workers), busy, SPLIT_BUSY, points, vocab_size)
    return samples


def _local_worker(role: str, loaded: LoadedModel, config: EngineConfig, executor) -> Worker:
    """A worker of `role` whose runner is the one `diptych worker` builds (pool size, graphs, attention)."""
    engine = build_engine(loaded, config, executor)
    sized = replace(config, num_kv_blocks=engine.kv.num_blocks)
    context = loaded.context_length
    return Worker(role, loaded.model, executor, True, config=sized, context_length=context, runner=engine.runner)


@dataclass(frozen=True)
class WorkerCalls:
    """Greedy requests straight to workers in this process: to one worker's Generate (a colocated worker,
    or a decode worker taking a short prompt whole), or to a split pair, the decode call first."""

    worker: Worker
    decode: Worker | None = None

    async def generate(self, prompt_token_ids: list[int], max_tokens: int) -> RequestResult:
        sampling = worker_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request_id = f"live-{random.randbytes(6).hex()}"
        result = RequestResult(sent_at=time.perf_counter(), prompt_tokens=len(prompt_token_ids))
        if self.decode is None:
            work = worker_pb2.GenerateWork(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling)
            async for event in self.worker.stub.Generate(work):
                result.token_times.append(time.perf_counter())
                result.token_ids.append(event.token_id)
            return result
        decode_call, prefill_call = await split_calls(self.worker, self.decode, request_id, prompt_token_ids, sampling)
        async for event in prefill_call:
            if event.HasField("first_token"):
                result.token_times.append(time.perf_counter())
                result.token_ids.append(event.first_token.token_id)
            if event.HasField("kv_delivered"):
                result.kv_bytes = event.kv_delivered.kv_bytes
        async for event in decode_call:
            result.token_times.append(time.perf_counter())
            result.token_ids.append(event.token_id)
        return result


async def _live_requests(
    client: Client, busy_client: Client | None, mode: str, points: PointSets, vocab_size: int
) -> list[LiveSample]:
    """The sampled requests of `mode` through `client`, after a warm-up; with `busy_client`, while it keeps
    the decode worker decoding."""
    rng = random.Random(f"live {mode}")  # fresh prompts each pass: none finds another's blocks cached
    samples: list[LiveSample] = []
    for prompt_tokens in points.live_prompts:  # warm-up: connections, the workers' first steps; not counted
        await client.generate(random_tokens(rng, prompt_tokens, vocab_size), points.live_output_tokens)
    stop = asyncio.Event()
    busy = asyncio.create_task(_keep_decoding(busy_client, vocab_size, stop)) if busy_client else None
    try:
        await _sample_requests(client, mode, points, vocab_size, rng, samples)
    finally:
        stop.set()
        if busy is not None:
            await busy
    return samples


async def _keep_decoding(client: Client, vocab_size: int, stop: asyncio.Event) -> None:
    """One request after another decoding on the decode worker alone, until `stop`."""
    rng = random.Random(23)
    while not stop.is_set():
        result = await client.generate(random_tokens(rng, BUSY_PROMPT_TOKENS, vocab_size), BUSY_OUTPUT_TOKENS)
        if not result.ok:
            raise RuntimeError(f"a request keeping the decode worker busy failed: {result.error}")


async def _sample_requests(
    client: Client, mode: str, points: PointSets, vocab_size: int, rng: random.Random, samples: list[LiveSample]
) -> None:
    await asyncio.sleep(0.5)  # a busy decode worker is in its steady steps
    for _ in range(points.live_rounds):
        for prompt_tokens in points.live_prompts:
            result = await client.generate(random_tokens(rng, prompt_tokens, vocab_size), points.live_output_tokens)
            if not result.ok or result.tpot is None:
                raise RuntimeError(f"a live request of {prompt_tokens} prompt tokens failed: {result.error}")
            second = result.token_times[1] - result.token_times[0]
            samples.append(LiveSample(mode, prompt_tokens, len(result.token_ids), result.ttft, result.tpot, second))
            log(f"live {mode}: {prompt_tokens}-token prompt, TTFT {result.ttft:.3f} s, TPOT {result.tpot:.4f} s")


def overheads(profile: CostProfile, samples: list[LiveSample]) -> tuple[float, float]:
    """(TTFT, per token): the median of what each live request took beyond the engine steps it needed
    (its prompt alone, then one decode step per token alone, each at its context), never below zero."""
    ttft_extra = [s.ttft_s - _prompt_alone_s(profile, s.prompt_tokens) for s in samples]
    token_extra = [s.tpot_s - _decode_alone_s(profile, s) for s in samples]
    return max(0.0, statistics.median(ttft_extra)), max(0.0, statistics.median(token_extra))


def _decode_alone_s(profile: CostProfile, sample: LiveSample) -> float:
    """The mean decode step of a lone sequence over the sample's output tokens after the first."""
    return statistics.mean(profile.decode_step_s(1, sample.prompt_tokens + i) for i in range(1, sample.output_tokens))


def handoff_extra_s(profile: CostProfile, samples: list[LiveSample]) -> float:
    """The median of what a split request's second token took beyond the KV transfer and one decode step:
    the hand-off's cost outside the data path (the decode worker taking the request, the gRPC hops)."""
    return statistics.median(
        s.second_token_s - profile.kv_transfer_s(s.prompt_tokens) - profile.decode_step_s(1, s.prompt_tokens + 1)
        for s in samples
    )


def _prompt_alone_s(profile: CostProfile, tokens: int) -> float:
    chunks, start = [], 0
    while start < tokens:
        chunks.append((min(profile.token_budget, tokens - start), start))
        start += chunks[-1][0]
    return sum(profile.step_s(n, 0, 0.0, [(n, s)]) for n, s in chunks)


# ---- the whole ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    profile: CostProfile
    live: list[LiveSample]  # the requests its overheads came from, and the split ones beside them
    mixed: list[MixedStep]  # mixed steps, to set against the profile's price of them
    live_through: str = "platform"  # LIVE_MODES


def measure_profile(
    model: str,
    threads: int,
    kv_cache_mib: int,
    points: PointSets,
    measured_with: str,
    hardware: str,
    device: str = "cpu",
    live: str = "platform",
) -> Measurement:
    """On `device`: a CUDA device runs the model in bfloat16, as `diptych worker --device cuda` does. `live`:
    the live requests through the platform, or to workers in this process (LIVE_MODES)."""
    torch.set_num_threads(threads)
    config = EngineConfig(kv_cache_mib=kv_cache_mib, device=device)
    log(f"loading {model} for {device} ({threads} torch thread(s))")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(model, f"builtin:{model}", dtype=dtype)
    points = points.within(loaded.context_length)
    with ThreadPoolExecutor(max_workers=1) as executor:
        engine = build_engine(loaded, config, executor)  # the worker's own sizing of the KV pool
    layout, capacity = engine.runner.layout, engine.kv.num_blocks * engine.kv.block_size
    del engine
    bench = StepBench(loaded, config.block_size, _blocks_needed(points, config.block_size), device)
    prefill = measure_prefill(bench, points)
    attention_pair_s = fit_attention_pair_s(bench, points, prefill)
    log(f"prefill attention: {attention_pair_s * 1e9:.1f} ns per (token, earlier token) pair")
    decode = measure_decode(bench, points)
    mixed = measure_mixed(bench, points)
    del bench
    kv_fixed, kv_per_token, _ = measure_kv_transfer(layout, points, device)
    profile = CostProfile(
        model=model,
        hardware=hardware,
        measured_with=measured_with,
        block_size=config.block_size,
        token_budget=config.token_budget,
        max_running=config.max_running,
        kv_capacity_tokens=capacity,
        prefill_points=tuple(prefill),
        decode_points=tuple(sorted(decode)),
        kv_fixed_s=kv_fixed,
        kv_per_token_s=kv_per_token,
        ttft_overhead_s=0.0,
        per_token_overhead_s=0.0,
        attention_pair_s=attention_pair_s,
    )
    vocab_size = loaded.model.config.vocab_size
    modes = ("colocated", "split")
    if live == "workers":
        samples = measure_live_workers(loaded, config, points, modes)
    else:
        samples = measure_live(model, loaded.context_length, threads, points, vocab_size, modes, device)
    ttft_overhead, per_token_overhead = overheads(profile, [s for s in samples if s.mode == "colocated"])
    busy = [s for s in samples if s.mode == SPLIT_BUSY]
    split_ttft_overhead = overheads(profile, busy)[0] if busy else None  # the TTFT part: its prefill ran alone
    profile = replace(
        profile,
        ttft_overhead_s=ttft_overhead,
        per_token_overhead_s=per_token_overhead,
        split_ttft_overhead_s=split_ttft_overhead,
    )
    return Measurement(profile, samples, mixed, live)


def _blocks_needed(points: PointSets, block_size: int) -> int:
    """Blocks for the largest decode batch at the longest context, or the longest prompt chunk."""
    decoding = max(points.decode_batches) * (max(points.decode_contexts) // block_size + 1)
    prompt = max(points.prefill_tokens) + max((start for _, start in points.attention_chunks), default=0)
    mixed = [
        batch * (context // block_size + 1) + -(-tokens // block_size) for tokens, batch, context in points.mixed_steps
    ]
    return max(decoding, -(-prompt // block_size), *mixed)


def render_table(measurement: Measurement) -> str:
    profile, samples = measurement.profile, measurement.live
    lines = [f"cost profile: {profile.model} on {profile.hardware}", "", "prefill step (one prompt from its start)"]
    lines += [f"  {tokens:>5} tokens  {seconds * 1000:9.1f} ms" for tokens, seconds in profile.prefill_points]
    lines.append(f"  attention: {profile.attention_pair_s * 1e9:.2f} ns per (token computed, earlier token) pair")
    contexts = sorted({c for _, c, _ in profile.decode_points})
    by_point = {(b, c): s for b, c, s in profile.decode_points}
    lines += ["", "decode step (ms)   " + "".join(f"{f'ctx {c}':>11}" for c in contexts)]
    for batch in sorted({b for b, _, _ in profile.decode_points}):
        cells = "".join(
            f"{by_point[(batch, c)] * 1000:11.1f}" if (batch, c) in by_point else f"{'':>11}" for c in contexts
        )
        lines.append(f"  batch {batch:>3}        {cells}")
    lines += [
        "",
        f"KV transfer: {profile.kv_fixed_s * 1000:.2f} ms + {profile.kv_per_token_s * 1e6:.2f} us per token",
        f"KV capacity of one worker: {profile.kv_capacity_tokens} tokens",
        "",
        "mixed steps (a colocated worker's): measured against the profile's price (step_s)",
    ]
    for step in measurement.mixed:
        priced = profile.step_s(step.prompt_tokens, step.batch, step.context + 1, [(step.prompt_tokens, 0)])
        lines.append(
            f"  {step.prompt_tokens:>4} prompt tokens + {step.batch:>2} sequences at context {step.context:>4}:"
            f" {step.seconds * 1000:8.1f} ms, priced {priced * 1000:8.1f} ms ({priced / step.seconds - 1:+.0%})"
        )
    lines += [
        "",
        f"live requests, one at a time, {LIVE_THROUGH[measurement.live_through]}, and the engine steps they needed"
        " alone (ms):",
        f"  {'mode':<10} {'prompt':>6} {'out':>4} {'TTFT':>8} {'engine':>8} {'2nd token':>9} {'KV+step':>8}"
        f" {'TPOT':>7} {'engine':>7}",
    ]
    for s in samples:
        handoff = profile.kv_transfer_s(s.prompt_tokens) + profile.decode_step_s(1, s.prompt_tokens + 1)
        lines.append(
            f"  {s.mode:<10} {s.prompt_tokens:>6} {s.output_tokens:>4} {s.ttft_s * 1000:8.1f}"
            f" {_prompt_alone_s(profile, s.prompt_tokens) * 1000:8.1f} {s.second_token_s * 1000:9.1f}"
            f" {handoff * 1000:8.1f} {s.tpot_s * 1000:7.2f} {_decode_alone_s(profile, s) * 1000:7.2f}"
        )
    lines.append(
        f"overhead outside the engine (colocated, in the profile): TTFT {profile.ttft_overhead_s * 1000:.2f} ms, "
        f"per token {profile.per_token_overhead_s * 1000:.3f} ms"
    )
    split = [s for s in samples if s.mode == "split"]
    if split:
        ttft, per_token = overheads(profile, split)
        lines.append(
            f"the same in split mode, one request at a time (not in the profile): TTFT {ttft * 1000:.2f} ms, per "
            f"token {per_token * 1000:.3f} ms; the second token beyond the KV transfer and one decode step "
            f"{handoff_extra_s(profile, split) * 1000:.2f} ms"
        )
    if profile.split_ttft_overhead_s is not None:
        lines.append(
            f"split TTFT overhead with the decode worker busy ({SPLIT_BUSY}, in the profile): "
            f"{profile.split_ttft_overhead_s * 1000:.2f} ms"
        )
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _parser() -> argparse.ArgumentParser:
    defaults = PointSets()
    parser = argparse.ArgumentParser(prog="python -m bench.phase_costs", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-100m", help="a built-in model")
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile (JSON)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as `diptych worker --threads`")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:n]: steps, KV staging and live workers there")
    parser.add_argument("--kv-cache-mib", type=int, default=EngineConfig.kv_cache_mib, help="the worker's KV memory")
    parser.add_argument("--hardware", help="the profile's hardware label (default: cpu-<cores>core-<threads>thread)")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed runs per point (the median)")
    parser.add_argument("--prefill-tokens", type=_ints, default=defaults.prefill_tokens, help="e.g. 16,64,512")
    parser.add_argument("--decode-batches", type=_ints, default=defaults.decode_batches)
    parser.add_argument("--decode-contexts", type=_ints, default=defaults.decode_contexts)
    parser.add_argument("--kv-tokens", type=_ints, default=defaults.kv_tokens, help="prompt lengths to transfer")
    parser.add_argument("--live-prompts", type=_ints, default=defaults.live_prompts)
    parser.add_argument("--live-output-tokens", type=int, default=defaults.live_output_tokens)
    parser.add_argument("--live-rounds", type=int, default=defaults.live_rounds)
    parser.add_argument(
        "--live", choices=LIVE_MODES, default="platform", help="live requests through the platform, or to workers"
    )
    return parser


def _hardware_label(device: str, threads: int) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device)).lower().replace(" ", "-")
    return f"cpu-{os.cpu_count()}core-{threads}thread"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.live_rounds < 1 or args.live_output_tokens < 2:
        raise SystemExit("--threads, --repeats and --live-rounds must be at least 1, --live-output-tokens at least 2")
    points = replace(
        PointSets(),
        prefill_tokens=args.prefill_tokens,
        decode_batches=args.decode_batches,
        decode_contexts=args.decode_contexts,
        kv_tokens=args.kv_tokens,
        live_prompts=args.live_prompts,
        live_output_tokens=args.live_output_tokens,
        live_rounds=args.live_rounds,
        repeats=args.repeats,
    )
    hardware = args.hardware or _hardware_label(args.device, args.threads)
    command = shlex.join(["python", "-m", "bench.phase_costs", *(sys.argv[1:] if argv is None else argv)])
    load = os.getloadavg()[0]
    measurement = measure_profile(
        args.model, args.threads, args.kv_cache_mib, points, command, hardware, args.device, args.live
    )
    log(f"load average before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    print(render_table(measurement), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(measurement.profile, args.out)
    log(f"profile written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
