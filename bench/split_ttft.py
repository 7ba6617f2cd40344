"""A long prompt served split, by KV data path: when the first token comes back (the prefill worker samples
it), and how long after it the decode worker's first token follows (the KV hand-off's tail: what the
transfer could not overlap with the prompt's chunks, then the load and one decode step).

    .venv/bin/python -m bench.split_ttft --model diptych-100m --prompt-tokens 4096 --samples 3

A prefill and a decode worker (`bench.local_workers.Worker`) serve over real gRPC in this process, each
engine on a forward thread of its own, the KV moving on the path under test: TCP, shared memory, or NIXL
(where it is installed). Each sample sends every path a fresh prompt (no prefix hit anywhere), the paths
in turn, so that each sees the same machine load. The built-in models allow 2,048 positions; a longer
prompt runs on the same weights with the rotary embedding's range stretched (it has no weights).
"""

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack

import torch

from bench.local_workers import Worker, split_calls
from bench.progress import log
from diptych_common.builtin import BUILTIN_MODELS
from diptych_common.proto.v1 import worker_pb2
from workers.engine.core import EngineConfig
from workers.kv_connector.interfaces import LOOPBACK
from workers.kv_connector.nixl import nixl_staging, nixl_unavailable
from workers.runner.model_loader import build_builtin_model

PATHS = ("tcp", "shm", "nixl")


@dataclasses.dataclass
class Sample:
    ttft_s: float  # the Prefill call's first token
    hand_off_s: float  # from it to the Decode call's first token
    kv_bytes: int
    data_path: str  # as the prefill worker reports it


async def serve_split(prefill: Worker, decode: Worker, request_id: str, prompt: list[int]) -> Sample:
    """The decode call first (it waits for the KV), then the prefill call, as the gateway places them."""
    sampling = worker_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    started = time.perf_counter()
    decode_call, prefill_call = await split_calls(prefill, decode, request_id, prompt, sampling)
    first_token_at = 0.0
    kv_bytes, data_path = 0, ""
    async for event in prefill_call:
        if event.HasField("first_token"):
            first_token_at = time.perf_counter()
        if event.HasField("kv_delivered"):
            kv_bytes, data_path = event.kv_delivered.kv_bytes, event.kv_delivered.data_path
    decoded_at = 0.0
    async for _ in decode_call:
        decoded_at = decoded_at or time.perf_counter()
    return Sample(first_token_at - started, decoded_at - first_token_at, kv_bytes, data_path)


def paths_here(wanted: list[str]) -> list[str]:
    reason = nixl_unavailable()
    if "nixl" in wanted and reason is not None:
        log(f"leaving out the nixl path: {reason}")
    return [path for path in wanted if path != "nixl" or reason is None]


async def run(args: argparse.Namespace) -> dict[str, list[Sample]]:
    builtin = BUILTIN_MODELS[args.model]
    positions = max(builtin.llama_config.get("max_position_embeddings", 0), args.prompt_tokens + 16)
    builtin = dataclasses.replace(builtin, llama_config={**builtin.llama_config, "max_position_embeddings": positions})
    log(f"building {args.model} ({positions} positions)")
    model = build_builtin_model(builtin).eval()
    blocks = 2 * (args.prompt_tokens // 16 + 2)
    config = EngineConfig(num_kv_blocks=blocks, token_budget=args.token_budget)
    vocab = model.config.vocab_size
    rng = random.Random(5)
    paths = paths_here(args.paths)
    results: dict[str, list[Sample]] = {path: [] for path in paths}
    async with AsyncExitStack() as stack:
        pairs = {}
        for path in paths:
            executors = [stack.enter_context(ThreadPoolExecutor(max_workers=1)) for _ in range(2)]
            prefill, decode = (
                Worker(
                    role,
                    model,
                    pool,
                    path == "shm",
                    config=config,
                    context_length=positions,
                    nixl=nixl_staging("on", role, LOOPBACK) if path == "nixl" else None,
                )
                for role, pool in zip(("prefill", "decode"), executors, strict=True)
            )
            for worker in (prefill, decode):
                await worker.start()
                stack.push_async_callback(worker.stop)
            pairs[path] = (prefill, decode)
        for path, (prefill, decode) in pairs.items():
            log(f"warming up the {path} pair")
            await serve_split(prefill, decode, f"warm-{path}", [rng.randrange(3, vocab) for _ in range(256)])
        for sample in range(args.samples):
            for path, (prefill, decode) in pairs.items():
                prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
                served = await serve_split(prefill, decode, f"s{sample}-{path}", prompt)
                results[path].append(served)
                log(
                    f"sample {sample + 1}/{args.samples}, {path}: TTFT {served.ttft_s * 1000:.0f} ms, "
                    f"hand-off {served.hand_off_s * 1000:.1f} ms, {served.kv_bytes / 1e6:.1f} MB"
                )
    return results


def render(args: argparse.Namespace, results: dict[str, list[Sample]]) -> str:
    lines = [
        f"split TTFT, {args.model}, prompts of {args.prompt_tokens} tokens ({args.token_budget} a step), "
        f"{args.samples} samples, medians:",
        f"{'path':<6} {'TTFT ms':>9} {'hand-off ms':>12} {'KV MB':>7}",
    ]
    for path, samples in results.items():
        ttft = statistics.median(s.ttft_s for s in samples) * 1000
        hand_off = statistics.median(s.hand_off_s for s in samples) * 1000
        reported = ",".join(sorted({s.data_path for s in samples}))
        lines.append(
            f"{path:<6} {ttft:>9.0f} {hand_off:>12.1f} {samples[0].kv_bytes / 1e6:>7.1f}  (reported: {reported})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.split_ttft", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-100m", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--token-budget", type=int, default=EngineConfig.token_budget, help="tokens per step")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both workers' forward threads)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(render(args, asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
