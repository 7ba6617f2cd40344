"""How busy the engine keeps its device, and what the host spends on each step.

The engine's closed loop (greedy requests, every output to its length, `concurrency` clients each sending its
next request when the last ends) fed straight into one engine in this process:

- host time per step per sequence, for each concurrency asked for: the loop's wall time over the sequence-steps
  it ran (one a token sampled), split into the time inside the engine's steps (forward pass and sampling on the
  forward thread) and outside them (scheduling, building the inputs, handing the tokens out). On a micro model
  (`diptych-tiny` on the CPU, the default there) the compute is negligible, so this is the host's cost per
  sequence per step;
- on a CUDA device, one more loop under `torch.profiler`: the device's kernel time and its busy time (kernels,
  copies and fills, overlaps counted once) over the wall time, device-to-host and host-to-device copies per
  step (count and bytes), the host's time in CUDA copy and synchronize calls per step, and the kernels that
  took the most device time.

    .venv/bin/python -m bench.gpu_busy --device cuda                 # diptych-1b, bfloat16, 64 streams, graphs on
    .venv/bin/python -m bench.gpu_busy --device cpu                  # diptych-tiny, float32: the host proxy
    .venv/bin/python -m bench.gpu_busy --device cpu --async-scheduling off,on --rounds 3   # medians, side by side
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_only import engine_closed_loop
from bench.progress import log
from bench.workload import BenchRequest, WorkloadSpec, make_requests
from diptych_common.builtin import BUILTIN_MODELS
from workers.engine.core import Engine, EngineConfig
from workers.main import build_engine
from workers.models.backends import ATTENTION_BACKENDS, AttentionBackendUnavailable, choose_backend
from workers.runner.model_loader import LoadedModel, load_model

# the profiler's names of device activities (libkineto's), and what each is here
DEVICE_ACTIVITIES = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "fill"}
HOST_WAIT_CALLS = ("cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


# ---- the closed loop and its steps ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopRun:
    """One closed loop: its wall time, its steps' times on the forward thread, the tokens it produced."""

    concurrency: int
    seconds: float
    step_ms: list[float]
    output_tokens: int
    async_scheduling: bool = True

    @property
    def steps(self) -> int:
        return len(self.step_ms)

    @property
    def sequences_per_step(self) -> float:
        """Sequences that sampled a token, per step (each token produced is one sequence-step)."""
        return self.output_tokens / self.steps

    def per_sequence_step_us(self) -> tuple[float, float, float]:
        """(all, inside the steps, outside them): host microseconds per sequence per step."""
        total = self.seconds * 1e6 / self.output_tokens
        inside = sum(self.step_ms) * 1000 / self.output_tokens
        return total, inside, total - inside


def requests_for(args, concurrency: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    spec = WorkloadSpec(
        requests=concurrency * args.requests_per_stream,
        prompt_tokens_mean=args.prompt_tokens,
        prompt_tokens_min=max(4, args.prompt_tokens // 4),
        prompt_tokens_max=args.prompt_tokens * 4,
        output_tokens_min=max(2, args.output_tokens // 2),
        output_tokens_max=args.output_tokens * 2,
        shared_prefix_share=0.0,
        shared_prefix_tokens=0,
        vocab_size=vocab_size,
        seed=seed,
    )
    return make_requests(spec)


async def timed_loop(engine: Engine, requests: list[BenchRequest], concurrency: int) -> LoopRun:
    steps: list[float] = []
    engine.on_step = lambda _tokens, step_ms: steps.append(step_ms)
    started = time.perf_counter()
    outputs = await engine_closed_loop(engine, requests, concurrency)
    seconds = time.perf_counter() - started
    engine.on_step = None
    return LoopRun(concurrency, seconds, steps, sum(map(len, outputs.values())))


def engine_config(args, concurrency: int, async_scheduling: bool = True) -> EngineConfig:
    return EngineConfig(
        async_scheduling=async_scheduling,
        device=args.device,
        kv_cache_mib=args.kv_cache_mib,
        max_running=concurrency,
        token_budget=args.token_budget,
        cuda_graphs=args.graphs,
        attention=args.attention,
    )


async def host_loops(loaded: LoadedModel, args) -> list[LoopRun]:
    """A warmed-up closed loop at each concurrency, on an engine of its own."""
    runs = []
    vocab_size = loaded.model.config.vocab_size
    for concurrency in args.concurrency:
        for round_index in range(args.rounds):  # the modes interleaved, their order alternating round by round
            for mode in args.async_scheduling[:: 1 if round_index % 2 == 0 else -1]:
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as executor:
                    engine = build_engine(loaded, engine_config(args, concurrency, mode), executor)
                    task = asyncio.create_task(engine.run())
                    try:
                        await engine_closed_loop(engine, requests_for(args, 1, vocab_size, seed=1)[:2], 2)
                        log(f"closed loop of {concurrency} streams, async scheduling {'on' if mode else 'off'}")
                        run = await timed_loop(engine, requests_for(args, concurrency, vocab_size, 11), concurrency)
                        runs.append(replace(run, async_scheduling=mode))
                    finally:
                        task.cancel()
    return runs


def render_host(runs: Sequence[LoopRun]) -> str:
    lines = [
        "host time per step per sequence (the closed loop's wall time over its sequence-steps)",
        f"{'streams':>7} {'steps':>6} {'seqs/step':>9} {'ms/step':>8} {'tok/s':>8} "
        f"{'us/seq-step':>11} {'in steps':>9} {'outside':>8}",
    ]
    for run in runs:
        total, inside, outside = run.per_sequence_step_us()
        lines.append(
            f"{run.concurrency:>7} {run.steps:>6} {run.sequences_per_step:>9.1f} {run.seconds * 1000 / run.steps:>8.2f}"
            f" {run.output_tokens / run.seconds:>8.0f} {total:>11.1f} {inside:>9.1f} {outside:>8.1f}"
        )
    return "\n".join(lines)


def render_modes(runs: Sequence[LoopRun]) -> str:
    """Asynchronous scheduling off and on, per concurrency: each round's host time per sequence-step, and the
    medians over the rounds."""
    lines = [
        "async scheduling off vs on: host us per sequence-step (each round, then the median) and output tok/s",
        f"{'streams':>7} {'async':>5} {'us/seq-step':>11} {'in steps':>9} {'outside':>8} {'tok/s':>8}  each round",
    ]
    for concurrency in dict.fromkeys(run.concurrency for run in runs):
        for mode in (False, True):
            own = [run for run in runs if run.concurrency == concurrency and run.async_scheduling == mode]
            if not own:
                continue
            per_round = [run.per_sequence_step_us() for run in own]
            total, inside, outside = (statistics.median(values) for values in zip(*per_round, strict=True))
            tok_s = statistics.median(run.output_tokens / run.seconds for run in own)
            rounds = " ".join(f"{us:.1f}" for us, _, _ in per_round)
            lines.append(
                f"{concurrency:>7} {'on' if mode else 'off':>5} {total:>11.1f} {inside:>9.1f} {outside:>8.1f} "
                f"{tok_s:>8.0f}  {rounds}"
            )
        pairs = _paired(runs, concurrency)
        if pairs:  # each round ran the two modes back to back: their ratio is steadier than either figure
            ratios = " ".join(f"{ratio:.2f}" for ratio in pairs)
            lines.append(f"{concurrency:>7} on/off us/seq-step, median {statistics.median(pairs):.2f}: {ratios}")
    return "\n".join(lines)


def _paired(runs: Sequence[LoopRun], concurrency: int) -> list[float]:
    """Per round, on's host time per sequence-step over off's (rounds hold one run of each, in turn)."""
    on = [run for run in runs if run.concurrency == concurrency and run.async_scheduling]
    off = [run for run in runs if run.concurrency == concurrency and not run.async_scheduling]
    if not on or len(on) != len(off):
        return []
    return [a.per_sequence_step_us()[0] / b.per_sequence_step_us()[0] for a, b in zip(on, off, strict=True)]


# ---- the device's share of the wall time -------------------------------------------------------------------


@dataclass(frozen=True)
class Activity:
    """One interval the profiler recorded: on the device (kernel, copy, fill) or a host call."""

    name: str
    kind: str  # kernel, copy, fill, or host
    start_ns: int
    end_ns: int
    nbytes: int = 0  # copies: the bytes moved

    @property
    def ns(self) -> int:
        return self.end_ns - self.start_ns


def device_kind(activity: str, name: str, on_device: bool, annotation: bool) -> str | None:
    """kernel, copy or fill for a device interval the profiler recorded; host for a host call; None for what
    is neither (user annotations mirrored on the device's timeline, synchronization records)."""
    if activity in DEVICE_ACTIVITIES:
        return DEVICE_ACTIVITIES[activity]
    if annotation:
        return None
    if not on_device:
        return "host"
    if activity and not activity.isdigit():  # another named device activity: annotations, syncs
        return None
    # a profiler that numbers its activities: tell them by name
    if name.startswith("Memcpy"):
        return "copy"
    if name.startswith("Memset"):
        return "fill"
    return None if "Sync" in name or "Wait" in name else "kernel"


def copy_bytes(metadata_json: str) -> int:
    """The bytes of a copy, from the metadata the profiler keeps with it (JSON members without braces)."""
    if not metadata_json:
        return 0
    try:
        return int(json.loads("{" + metadata_json + "}").get("bytes", 0))
    except (ValueError, TypeError):
        return 0


def activities_of(prof: profile) -> list[Activity]:
    """Every interval of a finished profile, classified."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profile holds no results: read it after its `with` block")
    found = []
    for event in results.events():
        activity = getattr(event, "activity_type", None)
        kind = device_kind(
            str(activity()) if activity is not None else "",
            event.name(),
            str(event.device_type()).endswith("CUDA"),
            bool(getattr(event, "is_user_annotation", lambda: False)()),
        )
        if kind is None:
            continue
        nbytes = copy_bytes(event.metadata_json()) if kind == "copy" else 0
        found.append(Activity(event.name(), kind, event.start_ns(), event.end_ns(), nbytes))
    return found


def covered_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """The length of the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


@dataclass(frozen=True)
class DeviceShare:
    wall_s: float
    steps: int
    kernel_s: float
    busy_s: float  # kernels, copies and fills, overlaps counted once
    copies: dict[str, tuple[int, int]]  # direction (DtoH, HtoD, DtoD, ...): (count, bytes)
    host_wait_s: float  # in the host's CUDA copy and synchronize calls
    top_kernels: list[tuple[str, float, int]]  # (name, seconds, launches), most time first


def copy_direction(name: str) -> str:
    """ "Memcpy DtoH (Device -> Pageable)" -> "DtoH"."""
    parts = name.split()
    return parts[1] if len(parts) > 1 else name


def device_share(activities: Sequence[Activity], wall_s: float, steps: int, top: int = 8) -> DeviceShare:
    on_device = [a for a in activities if a.kind != "host"]
    kernels = [a for a in on_device if a.kind == "kernel"]
    copies: dict[str, tuple[int, int]] = {}
    for a in on_device:
        if a.kind == "copy":
            count, nbytes = copies.get(copy_direction(a.name), (0, 0))
            copies[copy_direction(a.name)] = (count + 1, nbytes + a.nbytes)
    by_kernel: dict[str, list[int]] = defaultdict(list)
    for a in kernels:
        by_kernel[a.name].append(a.ns)
    ranked = sorted(((name, sum(ns) / 1e9, len(ns)) for name, ns in by_kernel.items()), key=lambda k: -k[1])
    waits = [a for a in activities if a.kind == "host" and a.name.startswith(HOST_WAIT_CALLS)]
    return DeviceShare(
        wall_s=wall_s,
        steps=steps,
        kernel_s=sum(a.ns for a in kernels) / 1e9,
        busy_s=covered_ns((a.start_ns, a.end_ns) for a in on_device) / 1e9,
        copies=copies,
        host_wait_s=sum(a.ns for a in waits) / 1e9,
        top_kernels=ranked[:top],
    )


async def profiled_loop(loaded: LoadedModel, args) -> tuple[DeviceShare, LoopRun]:
    """The closed loop at the last concurrency asked for, warmed up, then run again under the profiler."""
    concurrency = args.concurrency[-1]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as executor:
        engine = build_engine(loaded, engine_config(args, concurrency, args.async_scheduling[-1]), executor)
        task = asyncio.create_task(engine.run())
        try:
            vocab_size = loaded.model.config.vocab_size
            # the unprofiled loop ran these shapes already (kernel plans are per process): a short warm-up
            await engine_closed_loop(engine, requests_for(args, 1, vocab_size, seed=2)[:2], 2)
            log(f"closed loop of {concurrency} streams under torch.profiler")
            with profile(activities=activities) as prof:  # the requests of the unprofiled loop
                run = await timed_loop(engine, requests_for(args, concurrency, vocab_size, 11), concurrency)
        finally:
            task.cancel()
    log("reading the profile")
    return device_share(activities_of(prof), run.seconds, run.steps), run


def render_share(share: DeviceShare, plain: LoopRun | None) -> str:
    steps = share.steps
    if share.busy_s == 0:
        return f"under torch.profiler: {steps} steps in {share.wall_s:.2f} s; no device activity recorded"
    lines = [
        f"under torch.profiler: {steps} steps in {share.wall_s:.2f} s; device kernels {share.kernel_s:.3f} s = "
        f"{share.kernel_s / share.wall_s:.1%} of the wall time; device busy (kernels, copies, fills) "
        f"{share.busy_s:.3f} s = {share.busy_s / share.wall_s:.1%}",
    ]
    if plain is not None:
        lines.append(
            f"the same kernel time over the loop's wall time without the profiler ({plain.seconds:.2f} s): "
            f"{share.kernel_s / plain.seconds:.1%}"
        )
    for direction, (count, nbytes) in sorted(share.copies.items()):
        lines.append(
            f"copies {direction}: {count} ({count / steps:.2f} a step), {nbytes / 2**20:.2f} MiB "
            f"({nbytes / steps / 1024:.1f} KiB a step)"
        )
    if not share.copies:
        lines.append("copies between host and device: none recorded")
    lines.append(
        f"host time in CUDA copy and synchronize calls: {share.host_wait_s:.3f} s "
        f"({share.host_wait_s * 1000 / steps:.3f} ms a step)"
    )
    if share.top_kernels:
        lines.append(f"{'kernel (most device time first)':70s} {'ms':>9} {'launches':>9}")
        lines += [f"{name[:70]:70s} {seconds * 1000:9.1f} {n:9d}" for name, seconds, n in share.top_kernels]
    return "\n".join(lines)


# ---- the whole ------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _modes(text: str) -> list[bool]:
    words = text.split(",")
    if not words or any(word not in ("on", "off") for word in words) or len(set(words)) < len(words):
        raise argparse.ArgumentTypeError(f"{text!r}: give on, off, or both (on,off or off,on)")
    return [word == "on" for word in words]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_busy", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda[:n] (bfloat16), or cpu (float32)")
    p.add_argument("--model", choices=sorted(BUILTIN_MODELS), help="default: diptych-1b on cuda, diptych-tiny on cpu")
    p.add_argument("--concurrency", type=_ints, help="streams, comma-separated (default: 64 on cuda, 1,8,32 on cpu)")
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests each stream sends in a loop")
    p.add_argument("--prompt-tokens", type=int, help="mean prompt length (default: 128 on cuda, 16 on cpu)")
    p.add_argument("--output-tokens", type=int, default=64, help="mean output length")
    p.add_argument("--token-budget", type=int, default=2048, help="tokens per step")
    p.add_argument("--kv-cache-mib", type=int, help="the KV pool (default: 4096 on cuda, 128 on cpu)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True, help="CUDA graphs (CUDA)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS, help="the attention backend")
    p.add_argument("--profiler", action=argparse.BooleanOptionalAction, help="the profiled loop (default: on CUDA)")
    p.add_argument("--async-scheduling", type=_modes, default=[True], help="on, off, or both: on,off (default: on)")
    p.add_argument("--rounds", type=int, default=1, help="closed loops per concurrency and mode, interleaved")
    # the micro model's compute is negligible: more threads add only their wake-ups to each step
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("diptych-1b" if cuda else "diptych-tiny")
    args.concurrency = args.concurrency or ([64] if cuda else [1, 8, 32])
    args.prompt_tokens = args.prompt_tokens or (128 if cuda else 16)
    args.kv_cache_mib = args.kv_cache_mib or (4096 if cuda else 128)
    profiled = cuda if args.profiler is None else args.profiler
    if min(args.requests_per_stream, args.prompt_tokens, args.output_tokens, args.rounds) < 1:
        raise SystemExit("--requests-per-stream, --prompt-tokens, --output-tokens and --rounds must be at least 1")
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if cuda else torch.float32
    try:  # before the model loads: a backend asked for that cannot run here stops the run
        attention = choose_backend(args.attention, torch.device(args.device), dtype, EngineConfig.block_size)
    except AttentionBackendUnavailable as error:
        raise SystemExit(f"--attention {args.attention} cannot run on {args.device}: {error}") from None
    log(f"loading {args.model} ({str(dtype).removeprefix('torch.')}) for {args.device}")
    loaded = load_model(args.model, f"builtin:{args.model}", dtype=dtype)
    runs = asyncio.run(host_loops(loaded, args))
    graphs = f", CUDA graphs {'on' if args.graphs else 'off'}" if cuda else f", {args.threads} torch threads"
    print(
        f"{args.model} on {args.device}, {str(dtype).removeprefix('torch.')}{graphs}, attention {attention}", flush=True
    )
    side_by_side = len(args.async_scheduling) > 1 or args.rounds > 1
    print(render_modes(runs) if side_by_side else render_host(runs), flush=True)
    if profiled:
        share, _ = asyncio.run(profiled_loop(loaded, args))
        print(render_share(share, runs[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
