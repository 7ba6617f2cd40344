"""Output tokens/s at a fixed concurrency on a GPU model size: the Diptych engine with CUDA graphs off
and on (the gather attention backend), with the paged-cpu backend on the CPU and the flash-varlen one on
CUDA, against the
continuous-batching engine of `transformers` (the one `transformers serve --continuous-batching` runs), on
the same device and the same closed-loop workload, one after the other in one run.

Both engines run in this process and are fed token ids, so neither pays for HTTP or tokenization: what is
compared is the engines. Every output is greedy and runs to its length (end-of-sequence ignored), so both
produce the same number of tokens; how many outputs agree token for token is printed too (bfloat16 kernels
of different shapes may round differently, so a few may part ways late).

    .venv/bin/python -m bench.gpu_serving --device cuda              # diptych-1b in bfloat16, 64 streams
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
from workers.models.flash_varlen import unavailable_reason
from workers.models.paged_cpu import unavailable_reason as paged_cpu_unavailable
from workers.runner.model_loader import load_model


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


def run_diptych(loaded, requests: list[BenchRequest], args, cuda_graphs: bool, attention: str = "gather") -> Run:
    """`attention` flash-varlen runs on blocks of 256 tokens (its kernel's pages); gather on 16."""
    name = f"diptych, {attention}, CUDA graphs {'on' if cuda_graphs else 'off'}"
    config = EngineConfig(
        device=args.device,
        kv_cache_mib=args.kv_cache_mib,
        max_running=args.concurrency,
        token_budget=args.token_budget,
        cuda_graphs=cuda_graphs,
        attention=attention,
        block_size=256 if attention == "flash-varlen" else 16,
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
    batching = ContinuousBatchingConfig(max_requests_per_batch=args.concurrency, max_batch_tokens=args.token_budget)
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


def render(runs: list[Run], baseline: Run, args, loaded) -> str:
    parameters = sum(p.numel() for p in loaded.model.parameters())
    lines = [
        f"{args.model} ({parameters / 1e6:,.0f} M parameters) on {args.device}, {loaded.model.dtype}; "
        f"{args.requests} requests, {args.concurrency} concurrent",
        f"{'engine':36s} {'output tok/s':>12s} {'vs transformers':>16s} {'outputs equal':>14s}",
    ]
    for run in runs:
        lines.append(
            f"{run.name:36s} {run.tokens_per_s:12.0f} {run.tokens_per_s / baseline.tokens_per_s:15.2f}x "
            f"{agreeing(run, baseline):7d}/{len(baseline.outputs)}"
        )
    return "\n".join(lines)


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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    log(f"loading {args.model}")
    loaded = load_model(args.model, f"builtin:{args.model}", dtype=torch.bfloat16 if cuda else torch.float32)
    requests = workload(args, loaded.model.config.vocab_size)
    baseline = run_transformers(loaded, requests, args)
    runs = [run_diptych(loaded, requests, args, cuda_graphs=False)]
    if not cuda:
        reason = paged_cpu_unavailable(torch.device("cpu"), torch.float32)
        if reason is None:
            runs.append(run_diptych(loaded, requests, args, cuda_graphs=False, attention="paged-cpu"))
        else:
            log(f"paged-cpu not run: {reason}")
    else:
        runs.append(run_diptych(loaded, requests, args, cuda_graphs=True))
        reason = unavailable_reason(torch.device(args.device), torch.bfloat16, 256)
        if reason is None:
            runs.append(run_diptych(loaded, requests, args, cuda_graphs=True, attention="flash-varlen"))
        else:
            log(f"flash-varlen not run: {reason}")
    print(render([baseline, *runs], baseline, args, loaded), flush=True)
    log(f"median output length {statistics.median(map(len, baseline.outputs.values()))} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
