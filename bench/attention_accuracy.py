"""How far the triton attention kernel's output lies from the gather backend's, per dtype, over a grid of
steps read from a paged pool with shuffled blocks (docs/engine.md cites the table):

    .venv/bin/python -m bench.attention_accuracy

Each step mixes decoding rows, a prompt starting, an empty sequence, a chunk continuing its prompt across
block boundaries and a one-token prompt, with padding sequences and padding rows (`MIXED`), over several
head layouts (MHA, GQA 3:1 and 4:1, MQA 8:1), head sizes (64, 96, 128), block sizes (8 to 64) and windows;
then a few long contexts (`LONG`) through the split-KV path at 2 to 16 segments. For each it prints the
largest absolute difference of the kernel from gather, and of each from a float64 reference.

On CUDA the compiled kernel runs (and gather on the GPU); elsewhere the kernel runs under Triton's
interpreter (this sets TRITON_INTERPRET=1 before triton is imported), about a minute on two cores. The
tests (tests/workers/test_triton_attention.py) build their steps and reference here.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, fields

import torch

from workers.models.attention import AttentionPlan, GatherBuffers, Window, visible
from workers.models.step import StepInput

SENTINEL = 77.0  # what padding rows of `out` hold before a launch, and must hold after it

# (query rows, start) per sequence: decoding rows, a prompt starting (crossing blocks), an empty sequence
# between the others, a prompt chunk continuing across block boundaries, a one-token prompt
MIXED = [(1, 37), (20, 0), (0, 0), (9, 30), (1, 0), (1, 70)]
# two decoding rows over long contexts, a chunk continuing a long prompt, an empty sequence
LONG = [(1, 300), (3, 200), (0, 0), (1, 516)]

# (heads, kv_heads, head_dim, block_size, window) of the mixed steps
SHAPES = [
    (4, 4, 64, 16, None),
    (8, 2, 128, 16, 5),
    (8, 1, 64, 64, 20),
    (6, 2, 96, 8, 1),
    (4, 4, 128, 16, 24),
    (8, 2, 64, 32, 7),
]
# (num_splits, window) of the long steps, 4 query heads over 2 kv heads of 64
SPLITS = [(2, None), (4, 40), (8, 100), (16, None)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Step:
    """A layer's pool and one step over it, as the runner hands them to a backend, plus the kernel's
    padded metadata (padding sequences after the real ones, padding rows after the real rows)."""

    sequences: list[tuple[int, int]]
    layer_kv: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim]
    query: torch.Tensor  # [rows + padding rows, heads, head_dim]
    key: torch.Tensor  # the step's own keys and values [rows, kv_heads, head_dim], as written into the pool
    value: torch.Tensor
    query_start: torch.Tensor  # int32 [sequences + padding + 1]
    seq_lens: torch.Tensor  # int32 [sequences + padding]
    block_table: torch.Tensor  # int32 [sequences + padding, width]: ids outside the pool past each one's blocks
    tables: list[list[int]]
    rows: int

    def to(self, device: torch.device) -> Step:
        moved = {field.name: getattr(self, field.name) for field in fields(self)}
        for name in ("layer_kv", "query", "key", "value", "query_start", "seq_lens", "block_table"):
            moved[name] = moved[name].to(device)
        return Step(**moved)

    @property
    def inputs(self) -> list[StepInput]:
        """The non-empty sequences as a runner's step inputs (what the gather plan is built from)."""
        pairs = zip(self.sequences, self.tables, strict=True)
        return [StepInput([1] * length, start, table, True) for (length, start), table in pairs if length]

    @property
    def max_query_len(self) -> int:
        return max(length for length, _ in self.sequences)

    @property
    def max_seq_len(self) -> int:
        return max(length + start for length, start in self.sequences)


def make_step(sequences, heads, kv_heads, head_dim, block_size, dtype, padding_seqs=2, padding_rows=3, seed=0) -> Step:
    """A random pool holding `sequences` ((query rows, start) each) on shuffled blocks, and queries."""
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-(length + start) // block_size) for length, start in sequences]
    pool_blocks = sum(widths) + 2
    order = torch.randperm(pool_blocks, generator=generator).tolist()
    tables, used = [], 0
    for width in widths:
        tables.append(order[used : used + width])
        used += width
    layer_kv = torch.randn(2, pool_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    rows = sum(length for length, _ in sequences)
    query = torch.randn(rows + padding_rows, heads, head_dim, generator=generator).to(dtype)
    lengths = [length for length, _ in sequences] + [0] * padding_seqs
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([length + start for length, start in sequences] + [0] * padding_seqs, dtype=torch.int32)
    block_table = torch.full((len(lengths), max(widths) + 1), pool_blocks + 1000, dtype=torch.int32)
    for index, table in enumerate(tables):
        block_table[index, : len(table)] = torch.tensor(table, dtype=torch.int32)
    slots = [
        (table[position // block_size], position % block_size)
        for (length, start), table in zip(sequences, tables, strict=True)
        for position in range(start, start + length)
    ]
    key = torch.stack([layer_kv[0, block, slot] for block, slot in slots])
    value = torch.stack([layer_kv[1, block, slot] for block, slot in slots])
    return Step(sequences, layer_kv, query, key, value, query_start, seq_lens, block_table, tables, rows)


def reference(step: Step, scale: float, window: Window) -> torch.Tensor:
    """Float64 attention of each sequence's rows over its keys gathered from its blocks, on the CPU: row i
    of a chunk of n over k keys sits at position k - n + i and sees the keys `visible` from there."""
    out = torch.zeros(step.rows, *step.query.shape[1:], dtype=torch.float64)
    heads, kv_heads = step.query.shape[1], step.layer_kv.shape[3]
    layer_kv, query = step.layer_kv.cpu().double(), step.query.cpu().double()
    row = 0
    for (length, start), table in zip(step.sequences, step.tables, strict=True):
        if not length:
            continue
        count = start + length
        keys, values = (layer_kv[i][table].flatten(0, 1)[:count] for i in (0, 1))
        keys, values = (x.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for x in (keys, values))
        seen = visible(torch.arange(start, count)[:, None], torch.arange(count)[None], window)
        scores = (query[row : row + length].transpose(0, 1) @ keys.transpose(1, 2) * scale).masked_fill(
            ~seen, float("-inf")
        )
        out[row : row + length] = (scores.softmax(-1) @ values).transpose(0, 1)
        row += length
    return out


def gathered(step: Step, scale: float, window: Window) -> torch.Tensor:
    """What the gather backend attends over the same pool: [rows, heads, head_dim]."""
    block_size, kv_heads, head_dim = step.layer_kv.shape[2:]
    device = step.query.device
    buffers = GatherBuffers((block_size, kv_heads, head_dim), step.query.dtype, device)
    plan = AttentionPlan(step.inputs, block_size, device, buffers, 32, (window,))
    attended = plan.attend(step.query[: step.rows], step.key, step.value, step.layer_kv, scale, window)
    return attended.view(step.rows, *step.query.shape[1:])


def attended(step: Step, scale: float, window: Window, num_splits: int | None = None) -> torch.Tensor:
    """The kernel's `out` over the step, every row (padding rows were SENTINEL before): through the
    public entry, or with `num_splits` segments per tile."""
    from workers.models.triton_attention import launch_paged_attention, paged_attention

    out = torch.full_like(step.query, SENTINEL)
    metadata = (step.query_start, step.seq_lens, step.block_table, scale, window, step.max_query_len)
    if num_splits is None:
        paged_attention(step.query, step.layer_kv[0], step.layer_kv[1], out, *metadata, step.max_seq_len)
    else:
        launch_paged_attention(step.query, step.layer_kv[0], step.layer_kv[1], out, *metadata, num_splits)
    return out


@dataclass
class Errors:
    """Largest absolute differences over one step's real rows."""

    kernel_gather: float
    kernel_reference: float
    gather_reference: float
    padding_kept: bool


def measure(step: Step, scale: float, window: Window, num_splits: int) -> Errors:
    out = attended(step, scale, window, num_splits)
    kernel, expected, gather = out[: step.rows], reference(step, scale, window), gathered(step, scale, window)
    return Errors(
        float((kernel.double() - gather.double()).abs().max()),
        float((kernel.double().cpu() - expected).abs().max()),
        float((gather.double().cpu() - expected).abs().max()),
        bool((out[step.rows :] == SENTINEL).all()),
    )


@dataclass
class Case:
    label: str
    step: dict  # make_step's arguments, the dtype left out
    window: Window
    num_splits: int


def grid() -> list[Case]:
    cases = []
    for heads, kv_heads, head_dim, block_size, window in SHAPES:
        label = f"mixed, {heads}/{kv_heads} heads of {head_dim}, blocks of {block_size}, window {window}"
        shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size}
        cases.append(Case(label, {"sequences": MIXED, **shape}, window, 1))
    for num_splits, window in SPLITS:
        label = f"long, 4/2 heads of 64, blocks of 16, window {window}, {num_splits} splits"
        shape = {"heads": 4, "kv_heads": 2, "head_dim": 64, "block_size": 16}
        cases.append(Case(label, {"sequences": LONG, **shape}, window, num_splits))
    return cases


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.attention_accuracy", description=__doc__.splitlines()[0]).parse_args(
        argv
    )
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read by triton as the kernels are defined, at import
    device = torch.device("cuda" if cuda else "cpu")
    from workers.models import triton_attention

    reason = triton_attention.unavailable_reason(device, torch.float32)
    if reason is not None:
        print(f"the triton kernel cannot run here: {reason}", file=sys.stderr)
        return 1
    where = torch.cuda.get_device_name() if cuda else "the CPU, under Triton's interpreter"
    print(f"triton attention against gather on {where}: largest absolute difference over each step's rows\n")
    names = [str(dtype).removeprefix("torch.") for dtype in DTYPES]
    print("| step | " + " | ".join(f"{name}: kernel - gather (kernel, gather - float64)" for name in names) + " |")
    print("| --- |" + " --- |" * len(DTYPES))
    worst = dict.fromkeys(DTYPES, 0.0)
    kept = True
    for index, case in enumerate(grid()):
        scale = case.step["head_dim"] ** -0.5
        cells = []
        for dtype in DTYPES:
            step = make_step(**case.step, dtype=dtype, seed=index).to(device)
            errors = measure(step, scale, case.window, case.num_splits)
            worst[dtype] = max(worst[dtype], errors.kernel_gather)
            kept &= errors.padding_kept
            cells.append(f"{errors.kernel_gather:.1e} ({errors.kernel_reference:.1e}, {errors.gather_reference:.1e})")
        print(f"| {case.label} | " + " | ".join(cells) + " |")
    print("| **largest** | " + " | ".join(f"**{worst[dtype]:.1e}**" for dtype in DTYPES) + " |")
    print(f"\npadding rows left alone: {'yes' if kept else 'NO'}")
    return 0 if kept else 1


if __name__ == "__main__":
    sys.exit(main())
