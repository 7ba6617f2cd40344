"""Bytes moved prefill → decode on a multi-turn chat, whole caches against only the blocks the decode worker
lacks, side by side in one run.

    .venv/bin/python -m bench.kv_delta [--conversations 8] [--turns 6] [--reply-tokens 32] [--user-tokens 48]

Two prefill + decode pairs of the built-in tiny model run in this process over real gRPC and the real KV
data path (TCP, or shared memory with --shm). Each conversation opens with a system and user prompt;
each turn sends the whole conversation so far (every earlier prompt and reply) plus a new user message,
and the model's greedy reply joins the conversation. Both pairs get the same turns, the conversations of
a turn concurrently, the pair that goes first alternating from turn to turn:
  whole    the decode call gives no prompt: every turn's KV cache moves whole (as before this feature)
  missing  the decode call gives its prompt: the decode worker pins the blocks of it that its prefix cache
           holds (the earlier turns it served) and the prefill worker sends only the blocks after them
Reported per turn and in all: KV bytes moved (the prefill worker's delivery reports, checked against the
decode worker's count of bytes received), time to first token, and turn latency (the whole reply), as
seen by the caller. The replies of both pairs must be the same tokens.
"""

import argparse
import asyncio
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from bench.local_workers import Worker, split_calls
from bench.workload import random_tokens
from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.proto.v1 import worker_pb2
from workers.engine.core import EngineConfig
from workers.runner.model_loader import build_builtin_model

MODES = ("whole", "missing")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class TurnResult:
    reply: list[int]
    kv_bytes: int
    ttft_s: float
    latency_s: float


@dataclass
class ModeTotals:
    kv_bytes_by_turn: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)


async def run_turn(
    prefill: Worker, decode: Worker, request_id: str, prompt: list[int], reply_tokens: int, give_prompt: bool
) -> TurnResult:
    """One split request as the gateway runs it: the decode call first, then the prefill call."""
    sampling = worker_pb2.SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    started = time.perf_counter()
    decode_call, prefill_call = await split_calls(
        prefill, decode, request_id, prompt, sampling, "org-bench", give_prompt
    )
    first = await prefill_call.read()
    ttft = time.perf_counter() - started
    delivered = await prefill_call.read()
    reply = [first.first_token.token_id] + [event.token_id async for event in decode_call]
    return TurnResult(reply, delivered.kv_delivered.kv_bytes, ttft, time.perf_counter() - started)


async def run(args) -> int:
    torch.manual_seed(0)
    model = build_builtin_model(DIPTYCH_TINY).eval()
    vocab = DIPTYCH_TINY.llama_config["vocab_size"]
    config = EngineConfig(num_kv_blocks=args.kv_blocks, token_budget=512, cuda_graphs=False)
    executors: list[ThreadPoolExecutor] = []

    def worker(role: str) -> Worker:
        executors.append(ThreadPoolExecutor(max_workers=1))  # a forward thread of its own
        return Worker(role, model, executors[-1], args.shm, config=config, context_length=4096)

    pairs = {mode: (worker("prefill"), worker("decode")) for mode in MODES}
    for prefill, decode in pairs.values():
        await prefill.start()
        await decode.start()
    rng = random.Random(args.seed)
    conversations = [random_tokens(rng, args.opening_tokens, vocab) for _ in range(args.conversations)]
    totals = {mode: ModeTotals() for mode in MODES}
    mismatches = 0
    try:
        for turn in range(args.turns):
            if turn:
                conversations = [c + random_tokens(rng, args.user_tokens, vocab) for c in conversations]
            order = MODES if turn % 2 == 0 else tuple(reversed(MODES))
            replies: dict[str, list[TurnResult]] = {}
            for mode in order:
                prefill, decode = pairs[mode]
                replies[mode] = await asyncio.gather(
                    *(
                        run_turn(prefill, decode, f"c{i}-t{turn}", prompt, args.reply_tokens, mode == "missing")
                        for i, prompt in enumerate(conversations)
                    )
                )
                totals[mode].kv_bytes_by_turn.append(sum(r.kv_bytes for r in replies[mode]))
                totals[mode].ttft_s.extend(r.ttft_s for r in replies[mode])
                totals[mode].latency_s.extend(r.latency_s for r in replies[mode])
            mismatches += sum(w.reply != m.reply for w, m in zip(replies["whole"], replies["missing"], strict=True))
            conversations = [c + r.reply for c, r in zip(conversations, replies["whole"], strict=True)]
            progress(
                f"turn {turn + 1}/{args.turns}: prompts {min(map(len, conversations))}-{max(map(len, conversations))} "
                f"tokens after the reply"
            )
        received = {
            mode: (await pairs[mode][1].stub.GetLoad(worker_pb2.LoadRequest())).kv_bytes_received for mode in MODES
        }
    finally:
        for prefill, decode in pairs.values():
            await prefill.stop()
            await decode.stop()
        for executor in executors:
            executor.shutdown()
    report(args, totals, received, mismatches)
    return 1 if mismatches else 0


def report(args, totals: dict[str, ModeTotals], received: dict[str, int], mismatches: int) -> None:
    mib = 1 << 20
    print(
        f"kv_delta: {args.conversations} conversations x {args.turns} turns, diptych-tiny, "
        f"{'shm' if args.shm else 'tcp'} data path, replies of {args.reply_tokens} tokens, user turns of "
        f"{args.user_tokens} (opening {args.opening_tokens})"
    )
    print(f"{'turn':>4}  {'whole MiB':>10}  {'missing MiB':>11}  {'missing/whole':>13}")
    for turn, (whole, missing) in enumerate(
        zip(totals["whole"].kv_bytes_by_turn, totals["missing"].kv_bytes_by_turn, strict=True), start=1
    ):
        print(f"{turn:>4}  {whole / mib:>10.2f}  {missing / mib:>11.2f}  {missing / whole:>13.3f}")
    whole, missing = (sum(totals[mode].kv_bytes_by_turn) for mode in MODES)
    print(f"all   {whole / mib:>10.2f}  {missing / mib:>11.2f}  {missing / whole:>13.3f}")
    reported = {"whole": whole, "missing": missing}
    print(
        f"bytes received by the decode workers: whole {received['whole']}, missing {received['missing']} "
        f"({'equal to' if received == reported else 'DIFFERENT from'} the prefill workers' delivery reports)"
    )
    for label, attribute in (("time to first token", "ttft_s"), ("turn latency", "latency_s")):
        whole_p50, missing_p50 = (statistics.median(getattr(totals[mode], attribute)) for mode in MODES)
        whole_mean, missing_mean = (statistics.fmean(getattr(totals[mode], attribute)) for mode in MODES)
        print(
            f"{label}: p50 whole {whole_p50 * 1000:.1f} ms, missing {missing_p50 * 1000:.1f} ms "
            f"(x{missing_p50 / whole_p50:.2f}); mean whole {whole_mean * 1000:.1f} ms, "
            f"missing {missing_mean * 1000:.1f} ms (x{missing_mean / whole_mean:.2f})"
        )
    print(f"replies identical in both modes: {'yes' if not mismatches else f'NO ({mismatches} differ)'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--opening-tokens", type=int, default=64, help="the first turn's system and user prompt")
    parser.add_argument("--user-tokens", type=int, default=48, help="each later turn's user message")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=512, help="KV blocks of 16 tokens on every worker")
    parser.add_argument("--shm", action="store_true", help="the shared-memory data path (default: TCP)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.opening_tokens, args.reply_tokens) < 1 or args.user_tokens < 0:
        parser.error("conversations, turns, opening and reply tokens must be positive, user tokens not negative")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
