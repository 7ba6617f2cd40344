"""Output tokens/s at a fixed concurrency on a GPU model size: the Diptych engine on each attention backend
asked for, against the continuous-batching engine of `transformers` (the one `transformers serve
--continuous-batching` runs), on the same device and the same closed-loop workload, one after the other in
one run. On CUDA the first backend runs with CUDA graphs off and on and every other with graphs on (by
default gather, then triton: the path before the triton kernel and the one after); on the CPU, with graphs
off (by default gather, and paged-cpu where its operator builds). A backend asked for by name that cannot run
here stops the program before anything is measured.

Both engines run in this process and are fed token ids, so neither pays for HTTP or tokenization: what is
compared is the engines. Every output is greedy and runs to its length (end-of-sequence ignored), so both
produce the same number of tokens; how many outputs agree token for token is printed too (bfloat16 kernels
of different shapes may round differently, so a few may part ways late).

    .venv/bin/python -m bench.gpu_serving --device cuda              # diptych-1b in bfloat16, 64 streams
    .venv/bin/python -m bench.gpu_serving --device cuda --attention gather,triton,flash-varlen
    .venv/bin/python -m bench.gpu_serving --device cpu --model diptych-tiny --concurrency 8 --requests 16

With `--split`, the rest of the options go to `bench.gpu_split`: split serving (a prefill and a decode worker
over the real data path) against one colocated worker on the same device, with greedy parity between them.
"""

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from bench import gpu_split
from bench.engine_only import engine_closed_loop
from bench.progress import log
from bench.workload import BenchRequest, WorkloadSpec, make_requests
from diptych_common.builtin import BUILTIN_MODELS
from workers.engine.core import EngineConfig
from workers.main import build_engine
from workers.models.backends import ATTENTION_BACKENDS, AttentionBackendUnavailable, choose_backend
from workers.models.paged_cpu import unavailable_reason as paged_cpu_unavailable
from workers.runner.kv_pool import kv_layout_of
from workers.runner.model_loader import load_model

NAME_WIDTH = 40
TRANSFORMERS_PAGE_TOKENS = 256  # ContinuousBatchingConfig's page_size: tokens of every layer's K and V per block


@dataclass(frozen=True)
class Run:
    name: str
    tokens: int
    seconds: float
    outputs: dict[int, list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def workload(args, vocab_size: int) -> list[BenchRequest]:
    spec = WorkloadSpec(
        requests=args.requests,
        prompt_tokens_mean=args.prompt_tokens,
        prompt_tokens_min=max(4, args.prompt_tokens // 4),
        prompt_tokens_max=args.prompt_tokens * 4,
        output_tokens_min=args.output_tokens // 2,
        output_tokens_max=args.output_tokens * 2,
        shared_prefix_share=0.0,
        shared_prefix_tokens=0,
        vocab_size=vocab_size,
        seed=11,
    )
    return make_requests(spec)


def block_size_of(attention: str) -> int:
    """flash-varlen runs on blocks of 256 tokens (its kernel's pages); every other backend on 16."""
    return 256 if attention == "flash-varlen" else 16


def run_diptych(loaded, requests: list[BenchRequest], args, cuda_graphs: bool, attention: str = "gather") -> Run:
    name = f"diptych, {attention}, CUDA graphs {'on' if cuda_graphs else 'off'}"
    config = EngineConfig(
        device=args.device,
        kv_cache_mib=args.kv_cache_mib,
        max_running=args.concurrency,
        token_budget=args.token_budget,
        cuda_graphs=cuda_graphs,
        attention=attention,
        block_size=block_size_of(attention),
    )

    async def measure() -> Run:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as executor:
            log(f"[{name}] building the engine (KV pool {args.kv_cache_mib} MiB)")
            engine = build_engine(loaded, config, executor)
            loop_task = asyncio.create_task(engine.run())
            try:
                log(f"[{name}] warming up")
                await engine_closed_loop(engine, requests[:2], 2)
                log(f"[{name}] {len(requests)} requests, {args.concurrency} at a time")
                started = time.perf_counter()
                outputs = await engine_closed_loop(engine, requests, args.concurrency)
                seconds = time.perf_counter() - started
            finally:
                loop_task.cancel()
        return Run(name, sum(map(len, outputs.values())), seconds, outputs)

    return asyncio.run(measure())


def run_transformers(loaded, requests: list[BenchRequest], args) -> Run:
    """transformers' ContinuousBatchingManager, kept `concurrency` requests full by a closed loop."""
    name = "transformers continuous batching"
    model = loaded.model.to(args.device)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_tokens for r in requests))
    batching = transformers_batching(loaded, args)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.start()
    try:
        log(f"[{name}] warming up")
        _transformers_closed_loop(manager, requests[:2], 2)
        log(f"[{name}] {len(requests)} requests, {args.concurrency} at a time")
        started = time.perf_counter()
        outputs = _transformers_closed_loop(manager, requests, args.concurrency)
        seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    return Run(name, sum(map(len, outputs.values())), seconds, outputs)


def transformers_batching(loaded, args) -> ContinuousBatchingConfig:
    """transformers' continuous batching with the KV memory Diptych's pool gets (--kv-cache-mib): left to
    size its own cache it takes 60-90% of the device's free memory, of the host's on the CPU (12 GB of a
    23 GB machine, which the OOM killer took when other work needed its share)."""
    page = kv_layout_of(loaded.model.config, TRANSFORMERS_PAGE_TOKENS, loaded.model.dtype)
    return ContinuousBatchingConfig(
        max_requests_per_batch=args.concurrency,
        max_batch_tokens=args.token_budget,
        page_size=TRANSFORMERS_PAGE_TOKENS,
        num_blocks=max(1, (args.kv_cache_mib << 20) // page.block_nbytes),
    )


def _transformers_closed_loop(manager, requests: list[BenchRequest], concurrency: int) -> dict[int, list[int]]:
    """Keeps `concurrency` requests in the manager: each result that comes out lets the next request in."""
    pending = list(reversed(requests))
    outputs: dict[int, list[int]] = {}

    def submit() -> None:
        request = pending.pop()
        # An end-of-sequence id outside the vocabulary: every output runs to its length, as on Diptych.
        manager.add_request(request.prompt_token_ids, f"r{request.index}", request.output_tokens, eos_token_id=-1)

    for _ in range(min(concurrency, len(pending))):
        submit()
    while len(outputs) < len(requests):
        result = manager.get_result(timeout=600)
        if result is None or result.error:
            raise RuntimeError(f"transformers' continuous batching failed: {result and result.error}")
        outputs[int(result.request_id.removeprefix("r"))] = list(result.generated_tokens)
        if pending:
            submit()
    return outputs


def agreeing(run: Run, reference: Run) -> int:
    return sum(run.outputs[index] == tokens for index, tokens in reference.outputs.items())


def render(runs: list[Run], baseline: Run, before: Run | None, args, loaded) -> str:
    """The table: each engine's output tok/s, against transformers and against `before` (the first
    backend, with graphs on where there are graphs), and how many outputs equal transformers'."""
    parameters = sum(p.numel() for p in loaded.model.parameters())
    against = "" if before is None else before.name.removeprefix("diptych, ")
    lines = [
        f"{args.model} ({parameters / 1e6:,.0f} M parameters) on {args.device}, {loaded.model.dtype}; "
        f"{args.requests} requests, {args.concurrency} concurrent",
        f"{'engine':{NAME_WIDTH}s} {'output tok/s':>12s} {'vs transformers':>16s} {'outputs equal':>14s}"
        + (f"  vs {against}" if before else ""),
    ]
    for run in runs:
        line = (
            f"{run.name:{NAME_WIDTH}s} {run.tokens_per_s:12.0f} {run.tokens_per_s / baseline.tokens_per_s:15.2f}x "
            f"{agreeing(run, baseline):7d}/{len(baseline.outputs)}"
        )
        if before is not None and run is not baseline:
            line += f"  {run.tokens_per_s / before.tokens_per_s:.2f}x"
        lines.append(line)
    return "\n".join(lines)


def attention_backends(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in ATTENTION_BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(ATTENTION_BACKENDS)}, comma-separated")
    return names


def default_backends(cuda: bool) -> list[str]:
    """gather then triton on CUDA; gather, and paged-cpu where its operator builds, on the CPU."""
    if cuda:
        return ["gather", "triton"]
    reason = paged_cpu_unavailable(torch.device("cpu"), torch.float32)
    if reason is not None:
        log(f"paged-cpu not run: {reason}")
    return ["gather"] if reason else ["gather", "paged-cpu"]


def planned_runs(backends: list[str], cuda: bool) -> list[tuple[str, bool]]:
    """(backend, CUDA graphs): on CUDA the first backend with graphs off and on, every other with them on;
    on the CPU each with graphs off."""
    if not cuda:
        return [(backend, False) for backend in backends]
    return [(backends[0], False)] + [(backend, True) for backend in backends]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--split" in argv:
        return gpu_split.main([arg for arg in argv if arg != "--split"])
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--split", action="store_true", help="run bench.gpu_split with the other options instead")
    parser.add_argument("--model", default="diptych-1b", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--device", default="cuda", help="cuda[:n] (bfloat16), or cpu (float32) for a smoke run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="mean prompt length")
    parser.add_argument("--output-tokens", type=int, default=128, help="mean output length")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per step, both engines")
    parser.add_argument("--kv-cache-mib", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--attention", type=attention_backends, help="backends, comma-separated (default: gather,triton on cuda)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    backends = args.attention or default_backends(cuda)
    for backend in backends:  # before anything is measured: a backend asked for that cannot run stops the run
        try:
            choose_backend(backend, torch.device(args.device), dtype, block_size_of(backend))
        except AttentionBackendUnavailable as error:
            parser.error(f"--attention {backend} cannot run on {args.device}: {error}")
    log(f"loading {args.model}")
    loaded = load_model(args.model, f"builtin:{args.model}", dtype=dtype)
    requests = workload(args, loaded.model.config.vocab_size)
    baseline = run_transformers(loaded, requests, args)
    planned = planned_runs(backends, cuda)
    runs = [run_diptych(loaded, requests, args, graphs, backend) for backend, graphs in planned]
    before = runs[planned.index((backends[0], cuda))] if len(backends) > 1 else None
    print(render([baseline, *runs], baseline, before, args, loaded), flush=True)
    log(f"median output length {statistics.median(map(len, baseline.outputs.values()))} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
