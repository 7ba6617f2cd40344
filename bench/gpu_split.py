"""Split serving against colocated serving on one device, in one process, over the real data path.

A prefill worker and a decode worker (`bench.local_workers.Worker`: real gRPC services, the prefill worker's
KV sent to the decode worker by the real `KvSender`/`KvReceiver`), and beside them one colocated worker, each
with its own engine and KV pool on the device, share the model's weights. The same closed loop of greedy
requests (every output to its length) runs through the split pair, then through the colocated worker, and
the program prints for each output tokens/s, TTFT p50/p90 and, for split, the KV bytes and transfer time per
request; then how many outputs agree token for token between the two (and with `--reference N`, with
`transformers` `generate` on the first N prompts).

bfloat16 logits of a model with random weights are near ties everywhere, so greedy parity between two batch
shapes fails by rounding alone: check parity with `--dtype float32`.

    .venv/bin/python -m bench.gpu_split --device cuda                       # diptych-1b, bfloat16, 32 streams
    .venv/bin/python -m bench.gpu_split --device cuda --dtype float32 --requests 32 --reference 8
    .venv/bin/python -m bench.gpu_split --device cpu --model diptych-tiny --requests 8 --concurrency 4 \\
        --prompt-tokens 32 --output-tokens 8 --reference 2                  # a smoke run
"""

import argparse
import asyncio
import random
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch

from bench.local_workers import Worker, split_calls
from bench.migration_parity import first_difference
from bench.progress import log
from bench.stats import percentile
from bench.workload import random_tokens
from diptych_common.builtin import BUILTIN_MODELS
from diptych_common.proto.v1 import worker_pb2
from workers.engine.core import EngineConfig
from workers.models.backends import ATTENTION_BACKENDS, AttentionBackendUnavailable, choose_backend
from workers.runner.decode_graphs import DecodeGraphSpec
from workers.runner.model_loader import load_model
from workers.runner.model_runner import ModelRunner

BLOCK_SIZE = 16
PAD_TOKEN = 2  # the built-in tokenizers' <pad>
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 8


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    tokens: list[int]
    ttft_s: float
    seconds: float
    kv_bytes: int = 0  # split: the KV the prefill worker delivered
    transfer_ms: int = 0
    data_path: str = ""


@dataclass(frozen=True)
class ModeRun:
    name: str
    outcomes: list[Outcome]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o.tokens) for o in self.outcomes) / self.seconds

    def ttft_ms(self, q: float) -> float:
        return percentile([o.ttft_s * 1000 for o in self.outcomes], q)


@dataclass(frozen=True)
class Round:
    prompts: list[list[int]]
    split: ModeRun
    colocated: ModeRun

    def equal(self) -> int:
        return sum(s.tokens == c.tokens for s, c in zip(self.split.outcomes, self.colocated.outcomes, strict=True))

    def divergences(self) -> list[int]:
        """Where each pair of outputs that differs first parts ways, earliest first."""
        pairs = zip(self.split.outcomes, self.colocated.outcomes, strict=True)
        return sorted(at for s, c in pairs if (at := first_difference(s.tokens, c.tokens)) is not None)


@dataclass(frozen=True)
class Reference:
    """Outputs of `transformers` `generate` on the first prompts, against the last round's."""

    count: int
    split_equal: int
    colocated_equal: int


@dataclass(frozen=True)
class SplitReport:
    header: str
    dtype: str
    rounds: list[Round]
    reference: Reference | None
    kv_blocks: list[tuple[int, int]]  # (free, total) after the runs: prefill, decode, colocated


# ---- one request ------------------------------------------------------------------------------------------


def greedy(count: int) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)


async def split_request(prefill: Worker, decode: Worker, request_id: str, prompt: list[int], count: int) -> Outcome:
    """The gateway's order (`split_calls`): the decode call first (it expects the KV under the transfer token),
    then the prefill call, whose stream brings the first token and then the KV's delivery."""
    started = time.perf_counter()
    decode_call, prefill_call = await split_calls(prefill, decode, request_id, prompt, greedy(count))
    first: list[int] = []
    ttft, kv_bytes, transfer_ms, data_path = 0.0, 0, 0, ""
    async for event in prefill_call:
        if event.HasField("first_token"):
            first, ttft = [event.first_token.token_id], time.perf_counter() - started
        if event.HasField("kv_delivered"):
            delivered = event.kv_delivered
            kv_bytes, transfer_ms, data_path = delivered.kv_bytes, delivered.transfer_ms, delivered.data_path
    rest = [event.token_id async for event in decode_call]
    return Outcome(first + rest, ttft, time.perf_counter() - started, kv_bytes, transfer_ms, data_path)


async def colocated_request(worker: Worker, request_id: str, prompt: list[int], count: int) -> Outcome:
    started = time.perf_counter()
    tokens: list[int] = []
    ttft = 0.0
    call = worker.stub.Generate(
        worker_pb2.GenerateWork(request_id=request_id, prompt_token_ids=prompt, sampling=greedy(count))
    )
    async for event in call:
        if not tokens:
            ttft = time.perf_counter() - started
        tokens.append(event.token_id)
    return Outcome(tokens, ttft, time.perf_counter() - started)


Call = Callable[[str, list[int], int], Awaitable[Outcome]]


async def closed_loop(
    call: Call, prompts: list[list[int]], count: int, concurrency: int
) -> tuple[list[Outcome], float]:
    """Every prompt through `call`, `concurrency` at a time; the outcomes in prompt order and the wall seconds."""
    gate = asyncio.Semaphore(concurrency)
    tag = secrets.token_hex(4)

    async def one(index: int) -> Outcome:
        async with gate:
            return await call(f"r{index}-{tag}", prompts[index], count)

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return list(outcomes), time.perf_counter() - started


# ---- the workers --------------------------------------------------------------------------------------------


def blocks_per_request(args) -> int:
    """The blocks of the longest prompt and its output."""
    return -(-(args.prompt_tokens * 3 // 2 + args.output_tokens) // BLOCK_SIZE) + 1


def start_worker(role: str, model, executor, args, graphs: bool) -> Worker:
    """A worker of `role` whose runner is on the device, with decode graphs when asked (CUDA only)."""
    per_request = blocks_per_request(args)
    num_blocks = args.kv_blocks or 2 * args.concurrency * per_request
    config = EngineConfig(
        device=args.device,
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        token_budget=args.token_budget,
        max_running=args.concurrency,
        attention=args.attention,
    )
    spec = DecodeGraphSpec(args.concurrency, per_request) if graphs else None
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE, args.device, decode_graphs=spec, attention=args.attention)
    context = max(4096, per_request * BLOCK_SIZE)
    return Worker(role, model, executor, allow_shm=args.shm, config=config, context_length=context, runner=runner)


def make_prompts(count: int, mean: int, vocab_size: int, seed: str) -> list[list[int]]:
    """Prompts of mean ± half of mean tokens (each round its own, so no prompt finds another's KV cached)."""
    rng = random.Random(seed)
    return [random_tokens(rng, rng.randint(max(1, mean // 2), mean * 3 // 2), vocab_size) for _ in range(count)]


async def measure_round(prefill: Worker, decode: Worker, colocated: Worker, prompts: list[list[int]], args) -> Round:
    def split_call(request_id: str, prompt: list[int], count: int) -> Awaitable[Outcome]:
        return split_request(prefill, decode, request_id, prompt, count)

    def colocated_call(request_id: str, prompt: list[int], count: int) -> Awaitable[Outcome]:
        return colocated_request(colocated, request_id, prompt, count)

    log(f"split: {len(prompts)} requests, {args.concurrency} at a time")
    split, split_s = await closed_loop(split_call, prompts, args.output_tokens, args.concurrency)
    log(f"colocated: {len(prompts)} requests, {args.concurrency} at a time")
    together, together_s = await closed_loop(colocated_call, prompts, args.output_tokens, args.concurrency)
    return Round(
        prompts,
        ModeRun("split (1 prefill + 1 decode)", split, split_s),
        ModeRun("colocated (1 worker)", together, together_s),
    )


def generate_reference(model, prompts: list[list[int]], count: int, device: str) -> list[list[int]]:
    """`transformers` `generate`, batch 1, greedy, every output `count` tokens long."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                pad_token_id=PAD_TOKEN,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


async def measure(model, args) -> tuple[list[Round], list[tuple[int, int]]]:
    """The rounds, and each worker's (free, total) KV blocks afterwards."""
    cuda = args.device.startswith("cuda")
    vocab_size = model.config.vocab_size
    async with AsyncExitStack() as stack:
        executors = [stack.enter_context(ThreadPoolExecutor(max_workers=1)) for _ in range(3)]
        log("building the workers" + (" and capturing decode graphs" if cuda and args.graphs else ""))
        prefill = start_worker("prefill", model, executors[0], args, graphs=False)
        decode = start_worker("decode", model, executors[1], args, graphs=cuda and args.graphs)
        colocated = start_worker("colocated", model, executors[2], args, graphs=cuda and args.graphs)
        workers = (prefill, decode, colocated)
        for worker in workers:
            await worker.start()
            stack.push_async_callback(worker.stop)
        log("warming up")
        warmup = make_prompts(WARMUP_REQUESTS, args.prompt_tokens, vocab_size, "warm-up")
        await closed_loop(lambda r, p, c: split_request(prefill, decode, r, p, c), warmup, WARMUP_TOKENS, 4)
        await closed_loop(lambda r, p, c: colocated_request(colocated, r, p, c), warmup, WARMUP_TOKENS, 4)
        rounds = []
        for number in range(args.rounds):
            prompts = make_prompts(args.requests, args.prompt_tokens, vocab_size, f"round {number}")
            rounds.append(await measure_round(prefill, decode, colocated, prompts, args))
        loads = [await worker.stub.GetLoad(worker_pb2.LoadRequest()) for worker in workers]
        blocks = [(load.kv_blocks_free, load.kv_blocks_total) for load in loads]
    return rounds, blocks


# ---- the whole ------------------------------------------------------------------------------------------------


def run(args) -> SplitReport:
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    try:  # before the model loads: a backend asked for that cannot run here stops the run
        attention = choose_backend(args.attention, torch.device(args.device), dtype, BLOCK_SIZE)
    except AttentionBackendUnavailable as error:
        raise SystemExit(f"--attention {args.attention} cannot run on {args.device}: {error}") from None
    log(f"loading {args.model} ({str(dtype).removeprefix('torch.')}) onto {args.device}")
    model = load_model(args.model, f"builtin:{args.model}", dtype=dtype).model
    model.to(args.device)
    rounds, blocks = asyncio.run(measure(model, args))
    reference = None
    if args.reference:
        log(f"transformers generate on {args.reference} prompts")
        last = rounds[-1]
        expected = generate_reference(model, last.prompts[: args.reference], args.output_tokens, args.device)
        reference = Reference(
            len(expected),
            sum(e == o.tokens for e, o in zip(expected, last.split.outcomes, strict=False)),
            sum(e == o.tokens for e, o in zip(expected, last.colocated.outcomes, strict=False)),
        )
    parameters = sum(p.numel() for p in model.parameters())
    header = (
        f"{args.model} ({parameters / 1e6:,.0f} M parameters) on {args.device}, {str(dtype).removeprefix('torch.')}; "
        f"{args.requests} requests, {args.concurrency} concurrent, prompts ~{args.prompt_tokens} tokens, "
        f"{args.output_tokens} out; KV over {'shared memory' if args.shm else 'TCP'}; attention {attention}"
    )
    return SplitReport(header, str(dtype).removeprefix("torch."), rounds, reference, blocks)


def render_mode(run: ModeRun) -> str:
    line = (
        f"{run.name:30s} {run.tokens_per_s:9.0f} tok/s  TTFT p50 {run.ttft_ms(50):8.1f} ms  "
        f"p90 {run.ttft_ms(90):8.1f} ms  wall {run.seconds:7.2f} s"
    )
    sent = [o for o in run.outcomes if o.kv_bytes]
    if sent:
        paths = ",".join(sorted({o.data_path for o in sent}))
        line += (
            f"  KV {statistics.mean(o.kv_bytes for o in sent) / 2**20:.2f} MiB/request, transfer p50 "
            f"{percentile([float(o.transfer_ms) for o in sent], 50):.1f} ms ({paths})"
        )
    return line


def render(report: SplitReport) -> str:
    lines = [report.header]
    for number, result in enumerate(report.rounds, start=1):
        lines += [f"round {number}", render_mode(result.split), render_mode(result.colocated)]
        lines.append(
            f"greedy outputs equal, split vs colocated: {result.equal()}/{len(result.split.outcomes)}; "
            f"first divergence at token {result.divergences()[:10]}"
        )
    if report.reference is not None:
        ref = report.reference
        lines.append(
            f"transformers generate ({report.dtype}) equal: split {ref.split_equal}/{ref.count}, "
            f"colocated {ref.colocated_equal}/{ref.count}"
        )
    lines.append(f"KV blocks free/total after the runs (prefill, decode, colocated): {report.kv_blocks}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_split", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="diptych-1b", choices=sorted(BUILTIN_MODELS))
    p.add_argument("--device", default="cuda", help="cuda[:n], or cpu for a smoke run")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512, help="mean prompt length (each from half to 1.5x)")
    p.add_argument("--output-tokens", type=int, default=64, help="every output's length")
    p.add_argument("--token-budget", type=int, default=4096, help="tokens per step, every worker")
    p.add_argument("--kv-blocks", type=int, default=0, help="blocks of 16 tokens per worker (0: twice what fits)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of split then colocated, each on fresh prompts")
    p.add_argument("--reference", type=int, default=0, help="compare this many outputs with transformers generate")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True, help="decode graphs (CUDA)")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=False, help="KV over shared memory")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS, help="every worker's attention backend")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if min(args.requests, args.concurrency, args.rounds, args.output_tokens, args.prompt_tokens) < 1:
        raise SystemExit("--requests, --concurrency, --rounds, --prompt-tokens and --output-tokens must be at least 1")
    report = run(args)
    print(render(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
