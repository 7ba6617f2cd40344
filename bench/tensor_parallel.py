"""Tensor parallelism inside a worker, side by side with one rank: step times, tokens/s and what each rank
holds, in one run:

    .venv/bin/python -m bench.tensor_parallel                       # diptych-tiny, TP=1 against TP=2, CPU
    .venv/bin/python -m bench.tensor_parallel --model diptych-100m --degree 2 --threads 1

- a prefill step of one prompt and decode steps of several batch sizes, each on a TP=1 runner and on a
  TP=`--degree` runner (rank 0 here, the other ranks follower processes), alternated round by round,
  median of `--repeats`;
- the largest difference between their logits on the prefill step, and whether their greedy picks agree;
- per rank: the bytes of the attention and MLP weights (sharded), of the embedding, norms and LM head
  (whole on every rank), and of the KV pool for the same number of blocks.

On CPU with as many cores as ranks, TP buys no speed: each rank's matmuls are halved but two all-reduces a
layer and the operation broadcast are added, and the ranks share the cores. Its point is a model that
does not fit on one device; the figures show the cost and the halving.
"""

import argparse
import statistics
import sys
import time

import torch

from workers.models.step import StepInput
from workers.runner.model_loader import load_model
from workers.runner.model_runner import ModelRunner
from workers.runner.tensor_parallel import TensorParallelSpec, launch

SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(sharded, whole on every rank) bytes of the model's parameters as this rank holds them."""
    sharded = whole = 0
    for name, parameter in model.named_parameters():
        nbytes = parameter.numel() * parameter.element_size()
        if any(f".{part}." in name for part in SHARDED):
            sharded += nbytes
        else:
            whole += nbytes
    return sharded, whole


def decode_inputs(batch: int, context: int, block_size: int) -> list[StepInput]:
    """`batch` sequences decoding their token at position `context`, each over blocks of its own."""
    blocks = context // block_size + 1
    return [StepInput([5], context, list(range(i * blocks, (i + 1) * blocks)), True) for i in range(batch)]


def prefill_inputs(prompt: int, runner: ModelRunner) -> list[StepInput]:
    """One prompt of `prompt` tokens (ids 3.. of the vocabulary, repeating) from its first block."""
    token_ids = [3 + i % (runner.config.vocab_size - 3) for i in range(prompt)]
    return [StepInput(token_ids, 0, list(range(-(-prompt // runner.layout.block_size))), True)]


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-tiny")
    parser.add_argument("--degree", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:n] (bfloat16; rank r on cuda:n+r)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each rank")
    parser.add_argument("--prompt", type=int, default=512, help="tokens of the prefill step")
    parser.add_argument("--batches", default="1,8,32", help="decoding sequences per step, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="tokens each decoding sequence attends over")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    source = f"builtin:{args.model}"
    blocks_per_sequence = args.context // args.block_size + 1
    num_blocks = max(max(batches) * blocks_per_sequence, -(-args.prompt // args.block_size))

    print(f"loading {args.model} and starting {args.degree - 1} follower(s)", file=sys.stderr, flush=True)
    whole_model = load_model(args.model, source, dtype).model
    one = ModelRunner(whole_model.to(args.device), num_blocks, args.block_size, args.device)
    spec = TensorParallelSpec(
        args.degree,
        args.model,
        source,
        str(dtype).removeprefix("torch."),
        args.device,
        num_blocks,
        args.block_size,
        threads=args.threads,
    )
    sharded_model = load_model(args.model, source, dtype).model
    parallel = launch(sharded_model, spec)
    try:
        _memory(args.degree, whole_model, sharded_model, one, parallel)
        _correctness(one, parallel, args.prompt)
        _timings(args, one, parallel, batches)
    finally:
        parallel.close()
    return 0


def _memory(degree: int, whole_model, sharded_model, one: ModelRunner, parallel: ModelRunner) -> None:
    print(f"\nper rank, {one.num_blocks} KV blocks   {'TP=1':>12} {f'TP={degree}':>12} {'ratio':>7}")
    rows = [
        ("attention and MLP weights (sharded)", weight_bytes(whole_model)[0], weight_bytes(sharded_model)[0]),
        ("embedding, norms, LM head (whole)", weight_bytes(whole_model)[1], weight_bytes(sharded_model)[1]),
        ("KV pool", one.kv.numel() * one.kv.element_size(), parallel.kv.numel() * parallel.kv.element_size()),
    ]
    for what, single, per_rank in rows:
        print(f"{what:<37} {single / 2**20:9.2f} MiB {per_rank / 2**20:9.2f} MiB {per_rank / single:6.2f}x")


def _correctness(one: ModelRunner, parallel: ModelRunner, prompt: int) -> None:
    step = prefill_inputs(prompt, one)
    single, split = one.execute(step), parallel.execute(step)
    agree = bool((single.argmax(-1) == split.argmax(-1)).all())
    difference = (single - split).abs().max()
    print(f"\nlogits of a {prompt}-token prompt: largest difference {difference:.2e}, greedy picks agree: {agree}")


def _timings(args, one: ModelRunner, parallel: ModelRunner, batches: list[int]) -> None:
    steps = [(f"prefill, 1 x {args.prompt} tokens", prefill_inputs(args.prompt, one))]
    steps += [
        (f"decode, {b} x 1 token at {args.context}", decode_inputs(b, args.context, args.block_size)) for b in batches
    ]
    print(f"\n{'step':<32} {'TP=1 ms':>9} {'tok/s':>9} {f'TP={args.degree} ms':>9} {'tok/s':>9} {'speed-up':>8}")
    for what, inputs in steps:
        print(f"measuring {what}", file=sys.stderr, flush=True)
        tokens = sum(len(step.token_ids) for step in inputs)
        one.execute(inputs)  # warm
        parallel.execute(inputs)
        single_times, split_times = [], []
        for _ in range(args.repeats):  # alternated, so that both see the same machine
            single_times.append(median_ms(lambda step=inputs: one.execute(step), 1))
            split_times.append(median_ms(lambda step=inputs: parallel.execute(step), 1))
        single, split = statistics.median(single_times), statistics.median(split_times)
        print(
            f"{what:<32} {single:9.2f} {tokens / single * 1000:9.0f} {split:9.2f} {tokens / split * 1000:9.0f} "
            f"{single / split:7.2f}x"
        )


if __name__ == "__main__":
    raise SystemExit(main())
