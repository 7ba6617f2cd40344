"""Decode step time with and without a grammar, side by side: the cost of structured outputs.

Each batch size runs twice on the same engine: free text, then every request constrained by a JSON
schema (the token mask computed on the CPU by llguidance and applied to each row's logits before
sampling). Only the steps in which the whole batch decodes are timed.

    .venv/bin/python -m bench.constrained_decoding                        # diptych-100m (32000 tokens), CPU
    .venv/bin/python -m bench.constrained_decoding --device cuda --batch-sizes 1 8 32 128
"""

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from diptych_common.grammar import JSON_SCHEMA, Grammar, llguidance_tokenizer
from workers.engine.core import Engine, EngineConfig
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.main import build_engine
from workers.runner.model_loader import load_model
from workers.structured.compiler import GrammarCompiler

# An order with a list of lines that must hold more items than any run produces: no request completes
# its document early, so every timed step decodes the whole batch.
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 24},
        "lines": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "integer", "minimum": 0},
                    "size": {"enum": ["S", "M", "L", "XL"]},
                    "note": {"type": "string", "maxLength": 16},
                },
                "required": ["sku", "size", "note"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "lines"],
    "additionalProperties": False,
}


async def step_times(engine: Engine, compiler: GrammarCompiler | None, batch: int, args) -> list[float]:
    """Milliseconds of each step in which all `batch` requests decode."""
    times: list[float] = []
    engine.on_step = lambda tokens, ms: times.append(ms) if tokens == batch else None
    rng = random.Random(batch)
    grammar = Grammar(JSON_SCHEMA, json.dumps(SCHEMA))
    handles = []
    for index in range(batch):
        request = EngineRequest(
            f"{'g' if compiler else 'f'}{batch}.{index}",
            [rng.randrange(3, 500) for _ in range(args.prompt_tokens)],
            SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True),
            constraint=compiler.start(grammar, []) if compiler else None,
        )
        handles.append(engine.add(request))
    for handle in handles:
        while not (await handle.outputs.get()).finished:
            pass
    engine.on_step = None
    return times[1:]  # the first may still share its step with a prompt


async def run(args) -> None:
    torch.set_num_threads(args.threads)
    print(f"loading {args.model}", file=sys.stderr, flush=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    loaded = load_model(args.model, f"builtin:{args.model}", dtype=dtype)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    config = EngineConfig(device=args.device, max_running=max(args.batch_sizes), token_budget=4096, kv_cache_mib=1024)
    engine = build_engine(loaded, config, executor)
    compiler = GrammarCompiler(
        llguidance_tokenizer(loaded.tokenizer, loaded.model.config.vocab_size, loaded.eos_token_ids)
    )
    loop_task = asyncio.get_running_loop().create_task(engine.run())
    vocab = loaded.model.config.vocab_size
    print(f"{args.model} ({vocab} tokens), {args.device}, {args.output_tokens} tokens per request")
    print(f"{'batch':>5} {'free ms/step':>13} {'json ms/step':>13} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6}")
    try:
        await step_times(engine, None, 1, args)  # warm-up: the model, and the grammar's lexer states
        await step_times(engine, compiler, 1, args)
        for batch in args.batch_sizes:
            free, constrained = math.inf, math.inf
            for _ in range(args.repeats):  # alternated, the best median of each: other load on the machine skews less
                free = min(free, statistics.median(await step_times(engine, None, batch, args)))
                constrained = min(constrained, statistics.median(await step_times(engine, compiler, batch, args)))
            print(
                f"{batch:>5} {free:>13.2f} {constrained:>13.2f} {batch * 1000 / free:>11.1f} "
                f"{batch * 1000 / constrained:>11.1f} {constrained / free:>6.2f}x",
                flush=True,
            )
    finally:
        loop_task.cancel()
        executor.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.constrained_decoding", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-100m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
