"""The full profile's closed loop fed straight into one engine in this process, with no gateway, gRPC or
worker server: what the engine alone sustains on this machine, and what its steps cost.

    .venv/bin/python -m bench.engine_only --threads 2 --repeats 3
"""

import argparse
import asyncio
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.profiles import PROFILES
from bench.run import closed_loop_requests
from workers.engine.core import Engine, EngineConfig
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.main import build_engine
from workers.runner.model_loader import load_model


async def engine_closed_loop(engine: Engine, requests, concurrency: int) -> dict[int, list[int]]:
    """Greedy requests fed to the engine by `concurrency` clients, each sending its next request when the last
    one ends; returns each request's output tokens by its index."""
    queue = list(requests)
    outputs: dict[int, list[int]] = {}

    async def client() -> None:
        while queue:
            request = queue.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=request.output_tokens, ignore_eos=True)
            handle = engine.add(EngineRequest(f"r{request.index}", request.prompt_token_ids, params))
            tokens = outputs[request.index] = []
            while True:
                output = await handle.outputs.get()
                if isinstance(output, Exception):
                    raise output
                tokens.append(output.token_id)
                if output.finished:
                    break

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return outputs


async def _run(args, loaded) -> None:
    profile = PROFILES[args.profile]
    with ThreadPoolExecutor(max_workers=1) as executor:
        engine = build_engine(loaded, EngineConfig(token_budget=args.token_budget), executor)
        loop_task = asyncio.create_task(engine.run())
        rates = []
        for repeat in range(args.repeats):
            steps: list[tuple[int, float]] = []
            engine.on_step = lambda tokens, step_ms, steps=steps: steps.append((tokens, step_ms))
            started = time.perf_counter()
            outputs = await engine_closed_loop(engine, closed_loop_requests(profile, repeat), profile.concurrency)
            tokens = sum(map(len, outputs.values()))
            elapsed = time.perf_counter() - started
            rates.append(tokens / elapsed)
            print(
                f"run {repeat + 1}: {tokens} tokens in {elapsed:.1f} s = {rates[-1]:.0f} output tok/s, "
                f"{len(steps)} steps taking {sum(ms for _, ms in steps) / 1000:.1f} s"
            )
            _print_steps(steps)
        loop_task.cancel()
    print(f"median: {statistics.median(rates):.0f} output tok/s over {args.repeats} run(s)")


def _print_steps(steps: list[tuple[int, float]]) -> None:
    buckets = defaultdict(list)
    for tokens, step_ms in steps:
        buckets[1 if tokens == 1 else 2 ** (tokens - 1).bit_length()].append(step_ms)
    for size in sorted(buckets):
        times = buckets[size]
        print(f"    steps of ≤{size:4d} tokens: {len(times):3d}, mean {statistics.mean(times):6.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_only", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--token-budget", type=int, default=EngineConfig.token_budget)
    parser.add_argument("--repeats", type=int, default=3, help="closed loops, each on fresh prompts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    profile = PROFILES[args.profile]
    print(f"loading {profile.model}", file=sys.stderr, flush=True)
    loaded = load_model(profile.model, f"builtin:{profile.model}")
    asyncio.run(_run(args, loaded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
