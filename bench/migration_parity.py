"""How often a migrated greedy stream differs from the undisturbed one, and at what logit gap.

When a decode worker dies mid-stream the gateway re-runs prefill of the prompt plus the tokens already
sent on another pair and decodes on. The re-run computes those tokens' KV in one batched forward pass,
where decode computed it a token per step: the numbers differ in the last bits, and a greedy choice
between two near-tied tokens can flip. This program runs greedy streams of mixed prompt lengths in one
engine, undisturbed, then for each cut point k "migrates" every stream (prefill of prompt + first k
tokens as a fresh request on a fresh engine, greedy decode on) and compares the continuations; for
reference, it also compares the undisturbed streams with `transformers` generate.

    .venv/bin/python -m bench.migration_parity                          # diptych-tiny
    .venv/bin/python -m bench.migration_parity --model diptych-100m --streams 20 --output-tokens 128
"""

import argparse
import asyncio
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from bench.workload import random_tokens
from workers.engine.core import Engine, EngineConfig
from workers.engine.request import EngineRequest
from workers.engine.sampling import SamplingParams
from workers.main import build_engine
from workers.runner.model_loader import LoadedModel, load_model

TOP = 8  # logits kept per sampled token: enough to read the gap between two near-tied tokens


@dataclass
class Stream:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    top: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)  # token index → (values, ids)


@dataclass(frozen=True)
class Divergence:
    stream: int
    cut: int
    at: int  # index, in the whole stream, of the first token that differs
    undisturbed_margin: float | None  # undisturbed logit of its token minus that of the migrated one
    migrated_margin: float | None  # the other way round, in the migrated run


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """The first index where the two lists differ (a shorter list differs where it ends), else None."""
    for index, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return index
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def margin(top: tuple[list[float], list[int]] | None, winner: int, loser: int) -> float | None:
    """logit(winner) - logit(loser) from a token's top logits; None when either is not among them."""
    if top is None:
        return None
    values, ids = top
    if winner not in ids or loser not in ids:
        return None
    return values[ids.index(winner)] - values[ids.index(loser)]


def make_prompts(count: int, shortest: int, longest: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tokens(rng, rng.randint(shortest, longest), vocab_size) for _ in range(count)]


async def run_streams(engine: Engine, streams: list[Stream], output_tokens: int, already: int = 0) -> list[Stream]:
    """Runs one greedy request per stream, all at once; each result holds the tokens produced and the top
    logits of each, by token index in the whole stream."""
    results = [Stream(s.prompt + s.tokens[:already]) for s in streams]
    by_id = {f"s{i}": result for i, result in enumerate(results)}

    def record(requests, logits) -> None:  # on the forward thread, before sampling
        top = torch.topk(logits, min(TOP, logits.shape[-1]), dim=-1)
        for row, request in enumerate(requests):
            by_id[request.request_id].top[request.sample_index] = (top.values[row].tolist(), top.indices[row].tolist())

    engine.on_logits = record
    params = SamplingParams(
        temperature=0.0, max_tokens=output_tokens, ignore_eos=True, tokens_already_generated=already
    )
    handles = [engine.add(EngineRequest(request_id, result.prompt, params)) for request_id, result in by_id.items()]
    for handle, result in zip(handles, results, strict=True):
        while True:
            output = await handle.outputs.get()
            if isinstance(output, Exception):
                raise output
            result.tokens.append(output.token_id)
            if output.finished:
                break
    engine.on_logits = None
    return results


async def with_fresh_engine(loaded: LoadedModel, config: EngineConfig, work):
    with ThreadPoolExecutor(max_workers=1) as executor:
        engine = build_engine(loaded, config, executor)
        loop_task = asyncio.create_task(engine.run())
        try:
            return await work(engine)
        finally:
            loop_task.cancel()


def migrate_and_compare(undisturbed: list[Stream], migrated: list[Stream], cut: int) -> list[Divergence]:
    divergences = []
    for index, (whole, rest) in enumerate(zip(undisturbed, migrated, strict=True)):
        offset = first_difference(whole.tokens[cut:], rest.tokens)
        if offset is None:
            continue
        at = cut + offset
        if at >= len(whole.tokens) or offset >= len(rest.tokens):
            divergences.append(Divergence(index, cut, at, None, None))
            continue
        ours, theirs = whole.tokens[at], rest.tokens[offset]
        divergences.append(
            Divergence(index, cut, at, margin(whole.top.get(at), ours, theirs), margin(rest.top.get(at), theirs, ours))
        )
    return divergences


def largest_drift(undisturbed: list[Stream], migrated: list[Stream], cut: int) -> float:
    """The largest difference between the undisturbed and the migrated logit of the token both chose:
    the numerical noise a migration adds, which flips a greedy choice only where the top two are closer."""
    drift = 0.0
    for whole, rest in zip(undisturbed, migrated, strict=True):
        same = first_difference(whole.tokens[cut:], rest.tokens)
        for at in range(cut, cut + (len(rest.tokens) if same is None else same)):
            drift = max(drift, abs(whole.top[at][0][0] - rest.top[at][0][0]))
    return drift


def reference_differences(loaded: LoadedModel, streams: list[Stream], output_tokens: int) -> list[Divergence]:
    """Where each undisturbed stream unlike `generate`'s greedy tokens first differs, with the engine's
    logit gap between its token and generate's there."""
    differences = []
    for index, stream in enumerate(streams):
        ids = torch.tensor([stream.prompt])
        with torch.inference_mode():
            # transformers' self type for generate (GenerativePreTrainedModel) declares device and dtype settable,
            # which its models' read-only properties are not.
            out = loaded.model.generate(  # type: ignore[misc]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_tokens,
                min_new_tokens=output_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        expected = out[0, len(stream.prompt) :].tolist()
        at = first_difference(expected, stream.tokens)
        if at is not None:
            gap = margin(stream.top.get(at), stream.tokens[at], expected[at]) if at < len(expected) else None
            differences.append(Divergence(index, 0, at, gap, None))
        print(f"  transformers generate: {index + 1} of {len(streams)} streams", file=sys.stderr, flush=True)
    return differences


def _gap(value: float | None) -> str:
    return "not among the top logits" if value is None else f"{value:.2e}"


def print_divergences(cut: int, count: int, divergences: list[Divergence]) -> None:
    print(f"migrated after token {cut}: {len(divergences)} of {count} streams diverge")
    for d in divergences:
        print(
            f"    stream {d.stream}: from token {d.at}, logit gap undisturbed {_gap(d.undisturbed_margin)}, "
            f"migrated {_gap(d.migrated_margin)}"
        )


def smallest_top2_margin(streams: list[Stream]) -> float:
    """The closest call among all undisturbed greedy choices: how near a tie the streams came."""
    return min(values[0] - values[1] for s in streams for values, _ in s.top.values())


async def _run(args, loaded: LoadedModel) -> None:
    config = EngineConfig(token_budget=args.token_budget, kv_cache_mib=args.kv_cache_mib)
    vocab_size = loaded.model.config.vocab_size
    streams = [Stream(p) for p in make_prompts(args.streams, args.prompt_min, args.prompt_max, vocab_size, args.seed)]
    started = time.perf_counter()
    undisturbed = await with_fresh_engine(loaded, config, lambda e: run_streams(e, streams, args.output_tokens))
    print(
        f"  undisturbed: {len(streams)} streams in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True
    )
    cuts = sorted({min(args.output_tokens - 1, max(1, round(f * args.output_tokens))) for f in args.cuts})
    lengths = [len(s.prompt) for s in streams]
    print(
        f"{args.model}: {len(streams)} greedy streams, prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.output_tokens} tokens each, token budget {args.token_budget}"
    )
    print(f"closest top-2 logit margin among the undisturbed choices: {smallest_top2_margin(undisturbed):.2e}")
    everything: list[Divergence] = []
    for cut in cuts:
        started = time.perf_counter()
        migrated = await with_fresh_engine(
            loaded, config, lambda e, cut=cut: run_streams(e, undisturbed, args.output_tokens, already=cut)
        )
        print(f"  migrated after token {cut} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        divergences = migrate_and_compare(undisturbed, migrated, cut)
        print_divergences(cut, len(streams), divergences)
        print(
            f"    largest drift of the chosen token's logit where both chose it: "
            f"{largest_drift(undisturbed, migrated, cut):.2e}"
        )
        everything += divergences
    print(f"in all: {len(everything)} of {len(streams) * len(cuts)} migrated streams diverge")
    if not args.no_reference:
        differences = reference_differences(loaded, undisturbed, args.output_tokens)
        where = ", ".join(
            f"stream {d.stream} from token {d.at} (engine's logit gap {_gap(d.undisturbed_margin)})"
            for d in differences
        )
        print(
            f"reference: {len(differences)} of {len(streams)} undisturbed streams differ from transformers "
            f"generate{': ' + where if where else ''}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.migration_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["diptych-tiny", "diptych-100m"], default="diptych-tiny")
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--output-tokens", type=int, default=128, help="greedy tokens per stream")
    parser.add_argument("--prompt-min", type=int, default=8)
    parser.add_argument("--prompt-max", type=int, default=400)
    parser.add_argument(
        "--cuts", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="cut points, as fractions of --output-tokens"
    )
    parser.add_argument("--token-budget", type=int, default=EngineConfig.token_budget)
    parser.add_argument("--kv-cache-mib", type=int, default=EngineConfig.kv_cache_mib)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts")
    parser.add_argument("--no-reference", action="store_true", help="skip the comparison with transformers generate")
    args = parser.parse_args(argv)
    if not 1 <= args.prompt_min <= args.prompt_max:
        parser.error(
            f"--prompt-min ({args.prompt_min}) must be at least 1 and at most --prompt-max ({args.prompt_max})"
        )
    if args.output_tokens < 2 or args.streams < 1:
        parser.error("--output-tokens must be at least 2 (a cut needs tokens on both sides) and --streams at least 1")
    if not all(0.0 < f < 1.0 for f in args.cuts):
        parser.error(f"--cuts are fractions of the stream strictly between 0 and 1, got {args.cuts}")
    torch.set_num_threads(args.threads)
    print(f"loading {args.model}", file=sys.stderr, flush=True)
    loaded = load_model(args.model, f"builtin:{args.model}")
    if args.prompt_max + args.output_tokens > loaded.context_length:
        parser.error(
            f"--prompt-max + --output-tokens ({args.prompt_max + args.output_tokens}) must fit in "
            f"{args.model}'s context of {loaded.context_length} tokens"
        )
    asyncio.run(_run(args, loaded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
