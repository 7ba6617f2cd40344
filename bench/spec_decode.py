"""Speculative decoding in one engine, with and without drafts, side by side in one run: output tokens per
second, mean decode step time, acceptance rate and the speed-up, on a workload where drafting should help
(prompts that repeat a block of tokens, served by a model that continues by copying them) and on one where
it should not (random prompts on the built-in tiny model, whose continuation copies nothing).

    .venv/bin/python -m bench.spec_decode
    .venv/bin/python -m bench.spec_decode --method draft --draft-model builtin:diptych-tiny

The copying model (`copying_model`) is a two-layer Llama whose weights are set by hand rather than drawn
at random: layer 1 attends from each position to the one before it (through the rotary embedding) and
writes that token's code into the residual stream; layer 2 attends from the current token to the position
whose previous token is the same and copies the token found there (an induction head). Its greedy
continuation of a repeated block is the block again, as a trained model's would be; the random weights
of the built-in models copy nothing, so prompt lookup would have nothing to find.
"""

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.engine_only import engine_closed_loop
from bench.workload import BenchRequest
from diptych_common.builtin import DIPTYCH_TINY
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.runner.model_loader import build_builtin_model
from workers.runner.model_runner import ModelRunner
from workers.spec_decode.config import SpecConfig

# The copying model's shape: two heads of 128 dimensions; token codes of 64 dimensions.
_HEAD_DIM, _HEADS, _CODE_DIMS, _ROPE_THETA = 128, 2, 64, 1e6
_PREVIOUS_TOKEN_GAIN = 12.0  # sharpness of layer 1's attention to the position before
_MATCH_GAIN = 8.0  # sharpness of layer 2's attention to the earlier occurrence
_LOGIT_GAIN = 30.0


def copying_model(vocab_size: int = 512, seed: int = 0) -> LlamaForCausalLM:
    """A two-layer Llama that continues a sequence by copying what followed the latest earlier occurrence
    of its last token (see the module docstring); its token codes are random unit vectors drawn from `seed`."""
    hidden = _HEADS * _HEAD_DIM
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS,
        head_dim=_HEAD_DIM,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    codes = torch.randn(vocab_size, _CODE_DIMS, generator=torch.Generator().manual_seed(seed))
    codes /= codes.norm(dim=1, keepdim=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()  # the MLPs stay zero: attention alone copies
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        _set_copying_weights(model, codes)
    return model


def _set_copying_weights(model: LlamaForCausalLM, codes: torch.Tensor) -> None:
    # The residual stream's parts: the token's code, a constant, the previous token's code, the copied code.
    code, constant = slice(0, _CODE_DIMS), _CODE_DIMS
    previous = slice(_CODE_DIMS + 1, 2 * _CODE_DIMS + 1)
    copied = slice(2 * _CODE_DIMS + 1, 3 * _CODE_DIMS + 1)
    half = _HEAD_DIM // 2
    frequencies = 1.0 / _ROPE_THETA ** (torch.arange(half).double() * 2 / _HEAD_DIM)
    embed = model.model.embed_tokens.weight
    embed[:, code] = codes
    embed[:, constant] = 1.0
    scale = math.sqrt(2.0 / embed.shape[1])  # the embedding's RMS, which layer 1's input norm divides by
    # Layer 1: a query and key from the constant whose rotary pairs (the fastest dozen) agree only one
    # position apart: the query is each pair's key turned back by one position.
    first = model.model.layers[0].self_attn
    for pair in range(12):
        angle = frequencies[pair].item()
        first.q_proj.weight[pair, constant] = _PREVIOUS_TOKEN_GAIN * math.cos(angle) * scale
        first.q_proj.weight[pair + half, constant] = -_PREVIOUS_TOKEN_GAIN * math.sin(angle) * scale
        first.k_proj.weight[pair, constant] = _PREVIOUS_TOKEN_GAIN * scale
    for dim in range(_CODE_DIMS):
        first.v_proj.weight[dim, code.start + dim] = scale
        first.o_proj.weight[previous.start + dim, dim] = 1.0
    # Layer 2: the current code queries the previous codes, in the slowest rotary pairs (which turn by
    # under half a radian over the context), and the code found there is copied.
    second = model.model.layers[1].self_attn
    for index, pair in enumerate(range(half - _CODE_DIMS // 2, half)):
        for offset, dim in ((0, 2 * index), (half, 2 * index + 1)):
            second.q_proj.weight[pair + offset, code.start + dim] = _MATCH_GAIN
            second.k_proj.weight[pair + offset, previous.start + dim] = _MATCH_GAIN
    for dim in range(_CODE_DIMS):
        second.v_proj.weight[dim, code.start + dim] = 1.0
        second.o_proj.weight[copied.start + dim, dim] = 1.0
    model.lm_head.weight[:, copied] = codes * _LOGIT_GAIN


# ---- the benchmark ----------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    model: LlamaForCausalLM
    prompts: list[list[int]]


@dataclass
class RunFigures:
    """One closed-loop run of a workload through one engine."""

    tokens: int
    seconds: float
    decode_step_ms: list[float] = field(default_factory=list)  # steps in which no prompt token was computed
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def workloads(count: int, prompt_length: int, seed: int) -> list[Workload]:
    rng = random.Random(seed)
    repeated = []
    for _ in range(count):
        block = rng.sample(range(3, 512), rng.randrange(prompt_length // 8, prompt_length // 3))
        repeated.append((block * (prompt_length // len(block) + 1))[:prompt_length])
    random_prompts = [[rng.randrange(3, 512) for _ in range(prompt_length)] for _ in range(count)]
    copier, tiny = copying_model(), build_builtin_model(DIPTYCH_TINY).eval()
    return [
        Workload("repeated blocks, copying model", copier, repeated),
        Workload("random prompts, copying model", copier, random_prompts),
        Workload("random prompts, diptych-tiny", tiny, random_prompts),
    ]


async def closed_loop(engine: Engine, prompts: list[list[int]], output_tokens: int, concurrency: int) -> RunFigures:
    """Greedy requests fed by `concurrency` clients, each sending its next request when its last one ends."""
    figures = RunFigures(tokens=0, seconds=0.0)
    decode_only: list[bool] = []
    schedule = engine.scheduler.schedule

    def scheduled():  # notes whether each step computes decoding tokens only
        out = schedule()
        decode_only.append(all(c.num_tokens - len(c.draft_token_ids) == 1 and c.samples for c in out.chunks))
        return out

    def stepped(_tokens: int, step_ms: float) -> None:
        figures.steps += 1
        if decode_only[-1]:
            figures.decode_step_ms.append(step_ms)

    engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
    engine.on_step = stepped

    before = engine.stats()
    started = time.perf_counter()
    requests = [BenchRequest(index, prompt, output_tokens) for index, prompt in enumerate(prompts)]
    figures.outputs = await engine_closed_loop(engine, requests, concurrency)
    figures.seconds = time.perf_counter() - started
    after = engine.stats()
    figures.tokens = after.tokens_generated - before.tokens_generated
    figures.proposed = after.draft_tokens_proposed - before.draft_tokens_proposed
    figures.accepted = after.draft_tokens_accepted - before.draft_tokens_accepted
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return figures


async def measure(args, workload: Workload, spec: SpecConfig | None, executor) -> RunFigures:
    config = EngineConfig(num_kv_blocks=512, token_budget=args.token_budget, speculative=spec)
    runner = ModelRunner(workload.model, config.num_kv_blocks, config.block_size)
    engine = Engine(runner, config, StopCriteria(frozenset(), workload.model.config.max_position_embeddings), executor)
    task = asyncio.create_task(engine.run())
    try:
        await closed_loop(engine, workload.prompts[:2], 8, 2)  # warm-up
        return await closed_loop(engine, workload.prompts, args.output_tokens, args.concurrency)
    finally:
        task.cancel()


def _row(label: str, figures: list[RunFigures]) -> str:
    rate = statistics.median(f.tokens_per_s for f in figures)
    step_ms = statistics.mean(ms for f in figures for ms in f.decode_step_ms) if figures[0].decode_step_ms else 0.0
    steps = statistics.median(f.steps for f in figures)
    proposed, accepted = sum(f.proposed for f in figures), sum(f.accepted for f in figures)
    acceptance = f"{accepted / proposed:6.1%} of {proposed // len(figures):5d}" if proposed else "     -         "
    return (
        f"  {label:<6} {rate:8.1f} tok/s   decode step {step_ms:6.2f} ms   {steps:6.0f} steps   accepted {acceptance}"
    )


async def _run(args) -> None:
    spec = SpecConfig(
        args.method,
        num_draft_tokens=args.num_draft_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
    )
    print(
        f"{args.requests} requests of {args.prompt_tokens} prompt and {args.output_tokens} output tokens, "
        f"{args.concurrency} at a time, greedy; speculative: {args.method}, {args.num_draft_tokens} drafts; "
        f"{torch.get_num_threads()} threads; median of {args.repeats} alternated runs each"
    )
    with ThreadPoolExecutor(max_workers=1) as executor:
        for workload in workloads(args.requests, args.prompt_tokens, args.seed):
            runs: dict[str, list[RunFigures]] = {"off": [], args.method: []}
            for repeat in range(args.repeats):
                for label, setting in (("off", None), (args.method, spec)):
                    print(f"{workload.name}: run {repeat + 1}, speculative {label}", file=sys.stderr)
                    runs[label].append(await measure(args, workload, setting, executor))
            plain, speculative = runs["off"], runs[args.method]
            identical = all(p.outputs == s.outputs for p, s in zip(plain, speculative, strict=True))
            speed_up = statistics.median(f.tokens_per_s for f in speculative) / statistics.median(
                f.tokens_per_s for f in plain
            )
            print(f"{workload.name}:")
            print(_row("off", plain))
            print(_row(args.method, speculative))
            print(f"  speed-up {speed_up:.2f}x; greedy outputs identical with and without drafts: {identical}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    parser.add_argument("--draft-model", default="", help="draft: builtin:<name> or a model directory")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=SpecConfig.ngram_min)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
