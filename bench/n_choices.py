"""n choices in one request against the same choices as separate requests, on a live split platform
(diptych-tiny, one prefill and one decode worker): prompt tokens computed, KV bytes moved and wall time.

One request with n choices computes the prompt once (the extra choices recompute only its last, partial
block) and moves only that block to the decode worker; n concurrent requests of the same prompt each
compute and move it whole.

    .venv/bin/python -m bench.n_choices [--prompt-tokens 480] [--n 4] [--max-tokens 32] [--rounds 3]
"""

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import diptych
from bench.live_platform import start_platform

MODEL = "diptych-tiny"


@dataclass
class Cost:
    computed: int = 0  # prompt tokens the prefill worker computed (billed prompt minus its cache hit)
    kv_bytes: int = 0
    seconds: float = 0.0

    def add(self, usage: diptych.types.Usage) -> None:
        prefill = usage.prefill
        assert prefill is not None, "the gateway reported no prefill usage"
        self.computed += prefill.tokens - prefill.cached_tokens
        self.kv_bytes += prefill.kv_bytes


async def one_request(client, prompt: list[int], n: int, max_tokens: int) -> Cost:
    cost = Cost()
    started = time.perf_counter()
    completion = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=1, n=n)
    cost.seconds = time.perf_counter() - started
    cost.add(completion.usage)
    return cost


async def separate_requests(client, prompt: list[int], n: int, max_tokens: int) -> Cost:
    cost = Cost()
    started = time.perf_counter()
    completions = await asyncio.gather(
        *(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=i) for i in range(n))
    )
    cost.seconds = time.perf_counter() - started
    for completion in completions:
        cost.add(completion.usage)
    return cost


async def measure(address: str, api_key: str, args) -> None:
    rng = random.Random(0)
    async with diptych.AsyncClient(api_key=api_key, base_url=f"grpc://{address}", timeout=300) as client:
        await one_request(client, [5, 6, 7], 2, 2)  # warm up
        print(f"prompt {args.prompt_tokens} tokens, {args.n} choices of {args.max_tokens} tokens, split mode")
        print(f"{'way':<28}{'prompt tokens computed':>24}{'KV MiB moved':>14}{'seconds':>10}")
        for _ in range(args.rounds):
            for name, run in (("one request, n choices", one_request), ("n concurrent requests", separate_requests)):
                prompt = [rng.randrange(3, 512) for _ in range(args.prompt_tokens)]  # fresh: no earlier hit
                cost = await run(client, prompt, args.n, args.max_tokens)
                print(f"{name:<28}{cost.computed:>24}{cost.kv_bytes / 2**20:>14.2f}{cost.seconds:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.n_choices", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=480)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as state:
        platform = start_platform(Path(state), MODEL, 1024, split_threads=1, colocated_threads=2, log=print)
        try:
            with platform.serving("split") as address:
                asyncio.run(measure(address, platform.api_key, args))
        finally:
            platform.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
