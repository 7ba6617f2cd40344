"""The triton attention kernel gives what the gather backend and a float64 PyTorch reference give, over the
paged pool in place: mixed steps of prompt chunks (crossing block boundaries, continuing their prompts) and
decoding rows on shuffled blocks, empty and one-token sequences, padding sequences and padding rows left
alone, sliding windows, grouped- and multi-query heads, head sizes 64 and 128 (and one not a power of two),
block sizes below and above its key tile, float32, float16 and bfloat16, and the split-KV path with its merge.
On the CPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported); on CUDA it runs compiled, and a CUDA test fails where the kernel cannot run there."""

import copy
import os
import subprocess
import sys

import pytest
import torch

import workers.models.flash_varlen as flash_varlen_module
from bench.attention_accuracy import LONG, MIXED, SENTINEL, Step, attended, gathered, make_step, reference
from tests.workers.conftest import prefilled, prompts
from tests.workers.test_attention_backends import reference_varlen_attn
from workers.models import triton_attention
from workers.models.backends import AttentionBackendUnavailable, choose_backend
from workers.models.step import StepInput
from workers.models.triton_attention import (
    MAX_SPLITS,
    Tiles,
    TritonPlan,
    kv_splits,
    paged_attention,
    unavailable_reason,
)
from workers.runner.model_runner import ModelRunner

CPU = torch.device("cpu")
# where the kernel runs: compiled on a CUDA machine, else interpreted on the CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol) against the float64 reference; against gather (its own rounding too) twice that
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}


def assert_matches(step: Step, out: torch.Tensor, scale: float, window, against_gather: bool = True) -> None:
    """`out` (all of the kernel's rows) equals the reference and gather on the real rows, and still holds
    SENTINEL on the padding rows."""
    assert bool((out[step.rows :] == SENTINEL).all()), "a padding row was written"
    atol, rtol = TOLERANCE[step.query.dtype]
    rows = out[: step.rows]
    torch.testing.assert_close(rows.double().cpu(), reference(step, scale, window), atol=atol, rtol=rtol)
    if against_gather:
        torch.testing.assert_close(rows, gathered(step, scale, window), atol=2 * atol, rtol=2 * rtol)


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        (torch.float32, 4, 4, 64, 16, None),  # multi-head (1 query head per kv head)
        (torch.float32, 8, 2, 128, 16, 5),  # grouped 4:1, a window shorter than a block
        (torch.float32, 8, 1, 64, 64, 20),  # multi-query 8:1, blocks wider than the key tile
        (torch.float32, 6, 2, 96, 8, 1),  # 3:1 and a head size padded to 128; a window of the key itself
        (torch.float16, 8, 2, 64, 16, None),
        (torch.float16, 4, 4, 128, 16, 24),  # a window across block boundaries
        (torch.bfloat16, 8, 1, 128, 16, None),
        (torch.bfloat16, 8, 2, 64, 32, 7),
    ],
)
def test_a_mixed_step_attends_as_gather_and_the_reference_do(dtype, heads, kv_heads, head_dim, block_size, window):
    step = make_step(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim).to(DEVICE)
    scale = head_dim**-0.5
    assert_matches(step, attended(step, scale, window, num_splits=1), scale, window)


@pytest.mark.parametrize(
    ("dtype", "num_splits", "window"),
    [(torch.float32, 2, None), (torch.float32, 8, 100), (torch.float16, 4, 40), (torch.bfloat16, 8, None)],
)
def test_the_split_kv_path_merges_its_segments_into_what_one_pass_gives(dtype, num_splits, window):
    """Segments of each tile's keys attended in parallel, then merged; with 8 segments some hold no key of a
    row at all (or none at all), which must weigh nothing."""
    step = make_step(LONG, 4, 2, 64, 16, dtype, seed=num_splits).to(DEVICE)
    scale = 0.125
    split = attended(step, scale, window, num_splits=num_splits)
    assert_matches(step, split, scale, window)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(split, attended(step, scale, window, num_splits=1), atol=atol, rtol=rtol)


def test_the_split_rule_splits_few_rows_over_long_contexts_and_leaves_full_steps_alone():
    assert kv_splits(programs=8, max_seq_len=8192, multiprocessors=132) == MAX_SPLITS
    assert kv_splits(programs=40, max_seq_len=8192, multiprocessors=132) == 4  # about two programs per SM
    assert kv_splits(programs=8, max_seq_len=700, multiprocessors=132) == 2  # segments of 256 keys at least
    assert kv_splits(programs=8, max_seq_len=300, multiprocessors=132) == 1
    assert kv_splits(programs=132, max_seq_len=8192, multiprocessors=132) == 1
    assert {kv_splits(programs, 4096, 132) for programs in range(1, 140)} == {1, 2, 4, 8, 16}


def test_the_public_entry_takes_the_split_path_for_a_few_long_decoding_rows():
    step = make_step([(1, 1500), (1, 900)], 4, 2, 64, 16, torch.float32, padding_seqs=1, padding_rows=1).to(DEVICE)
    tiles = Tiles.of(step.query, step.layer_kv[0], max_query_len=1)
    programs = tiles.count(step.query.shape[0], step.seq_lens.shape[0]) * 2
    multiprocessors = triton_attention.INTERPRETED_MULTIPROCESSORS
    if DEVICE.type == "cuda":
        multiprocessors = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert kv_splits(programs, 1501, multiprocessors) > 1
    assert_matches(step, attended(step, 0.125, None), 0.125, None)


def test_the_tiles_come_from_shapes_and_cover_any_split_of_the_rows_into_sequences():
    query, pool = torch.empty(40, 8, 64), torch.empty(4, 16, 2, 64)
    decode, chunk = Tiles.of(query, pool, 1), Tiles.of(query, pool, 40)
    assert (decode.block_m, decode.block_q) == (16, 4)
    assert (chunk.block_m, chunk.block_q) == (64, 16)
    assert Tiles.of(torch.empty(4, 12, 96), torch.empty(4, 16, 4, 96), 1) == Tiles(5, 16, 128)
    # every sequence's tiles fit in the grid, however the rows fall: worst case, each ends just past a tile
    for tiles in (decode, chunk):
        size = tiles.block_q
        for lengths in ([40], [1] * 40, [size + 1, size + 1, 40 - 2 * size - 2, 0, 0]):
            starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
            ends = [
                start // size + index + -(-length // size)
                for index, (start, length) in enumerate(zip(starts, lengths, strict=True))
            ]
            assert max(ends) <= tiles.count(40, len(lengths))


def test_a_non_finite_key_reaches_the_rows_that_see_it_and_no_other():
    """NaN keys and values past a sequence's last key (in its last block), and NaN keys a window left behind
    or a row's causal mask hides, change nothing; a NaN key a row sees makes that row NaN."""
    step = make_step([(1, 13), (6, 10), (1, 40)], 4, 2, 64, 4, torch.float32, padding_seqs=0, padding_rows=0)
    kv, tables = step.layer_kv, step.tables
    kv[:, tables[0][3], 2:] = float("nan")  # past the first sequence's key 13 (its block's slot 1)
    kv[0, tables[1][3], 3] = float("nan")  # the chunk's key 15: its queries sit at 10..15, only the last sees it
    kv[0, tables[2][9], 0] = float("nan")  # key 36 of the third sequence: outside a window of 4 at 40
    out = attended(step.to(DEVICE), 0.125, 4, num_splits=1)
    assert bool(out[0].isfinite().all()) and bool(out[1:6].isfinite().all())
    assert bool(out[6].isnan().all())
    assert bool(out[7].isfinite().all())


class FixedBuffers:
    """A pool, metadata and query tensors of fixed shapes that steps are loaded into, as a captured CUDA
    graph's are: only their contents change from step to step."""

    def __init__(self, like: Step, pool_blocks: int, width: int, device: torch.device) -> None:
        self.pool = torch.zeros(2, pool_blocks, *like.layer_kv.shape[2:], dtype=like.query.dtype, device=device)
        self.block_table = torch.zeros(like.block_table.shape[0], width, dtype=torch.int32, device=device)
        self.query = torch.zeros(like.query.shape, dtype=like.query.dtype, device=device)
        self.query_start = torch.zeros_like(like.query_start, device=device)
        self.seq_lens = torch.zeros_like(like.seq_lens, device=device)
        self.out = torch.zeros_like(self.query)

    def load(self, step: Step) -> None:
        self.pool[:, : step.layer_kv.shape[1]].copy_(step.layer_kv)
        self.block_table.zero_()
        self.block_table[:, : step.block_table.shape[1]].copy_(step.block_table)
        for target, source in ((self.query, step.query), (self.query_start, step.query_start)):
            target.copy_(source)
        self.seq_lens.copy_(step.seq_lens)
        self.out.fill_(SENTINEL)

    def attend(self, scale: float, max_query_len: int, max_seq_len: int) -> None:
        pool = self.pool
        args = (self.query, pool[0], pool[1], self.out, self.query_start, self.seq_lens, self.block_table)
        paged_attention(*args, scale, None, max_query_len, max_seq_len)

    def check(self, step: Step) -> None:
        assert_matches(step, self.out, 0.088, None, against_gather=False)


def replayed_steps(dtype: torch.dtype) -> tuple[Step, Step]:
    """Two steps of the same shapes: 8 query rows (padding included) over 4 sequences (padding included)."""
    first = make_step([(4, 0), (1, 300), (1, 30)], 8, 2, 64, 16, dtype, padding_seqs=1, padding_rows=2, seed=1)
    second = make_step([(1, 44), (5, 3), (0, 0), (1, 700)], 8, 2, 64, 16, dtype, padding_seqs=0, padding_rows=1)
    return first, second


def test_the_same_buffers_serve_other_steps_of_the_same_shapes():
    """What a replayed CUDA graph does: the launch is planned from shapes and bounds alone, and the tensors
    are overwritten with another step (another split of the rows into sequences, other lengths)."""
    steps = replayed_steps(torch.float32)
    buffers = FixedBuffers(steps[0], 64, 48, DEVICE)
    for step in steps:
        buffers.load(step)
        buffers.attend(0.088, max_query_len=5, max_seq_len=768)
        buffers.check(step)


# ---- the plan and the runner ------------------------------------------------------------------------


def test_the_plan_holds_the_steps_offsets_key_counts_and_block_tables():
    inputs = [
        StepInput([7], 13, [9, 2, 30, 5], True),
        StepInput([8], 2, [11], True),
        StepInput([1, 2, 3, 4, 5, 6], 0, [20, 21], True),
        StepInput([4, 4, 4, 4, 4], 10, [3, 17, 8, 25], False),
    ]
    plan = TritonPlan.of(inputs, 4, CPU)
    assert plan.query_start.tolist() == [0, 1, 2, 8, 13] and plan.seq_lens.tolist() == [14, 3, 6, 15]
    assert plan.block_table.tolist() == [[9, 2, 30, 5], [11, 0, 0, 0], [20, 21, 0, 0], [3, 17, 8, 25]]
    assert plan.block_table.dtype == plan.query_start.dtype == plan.seq_lens.dtype == torch.int32
    assert (plan.max_query_len, plan.max_seq_len) == (6, 15) and plan.sample_rows == [0, 1, 7]


def on_the_device(model):
    """The built-in model where the kernel runs (a float32 copy on CUDA: the session's model stays put)."""
    return model if DEVICE.type == "cpu" else copy.deepcopy(model).to(DEVICE)


def test_a_runner_on_triton_gives_the_gather_runners_logits(tiny_model):
    model = on_the_device(tiny_model)
    gather = ModelRunner(model, num_blocks=64, block_size=16, device=DEVICE.type, attention="gather")
    fused = ModelRunner(model, num_blocks=64, block_size=16, device=DEVICE.type, attention="triton")
    assert fused.attention_backend == "triton"
    for runner in (gather, fused):
        runner.kv.copy_(torch.randn(runner.kv.shape, generator=torch.Generator().manual_seed(1)))
    decoding = prefilled(gather, [5, 20, 40])
    prefilled(fused, [5, 20, 40])
    torch.testing.assert_close(fused.kv, gather.kv, rtol=1e-4, atol=1e-4)
    step = [*decoding, StepInput(list(range(30, 42)), 0, [60, 61], True), StepInput([9] * 7, 16, [50, 51], True)]
    torch.testing.assert_close(fused.execute(step), gather.execute(step), rtol=1e-4, atol=1e-4)


def test_greedy_tokens_on_triton_are_those_of_transformers_generate(tiny_model, reference):
    """Two prompts prefilled in one step, then decoded together, each row's argmax fed back."""
    runner = ModelRunner(
        on_the_device(tiny_model), num_blocks=16, block_size=16, device=DEVICE.type, attention="triton"
    )
    texts = prompts([19, 33], salt=3)
    tables = [[4, 9], [1, 12, 7]]
    count = 4
    logits = runner.execute([StepInput(text, 0, table, True) for text, table in zip(texts, tables, strict=True)])
    tokens = [[int(row.argmax())] for row in logits]
    for _ in range(count - 1):
        step = [
            StepInput([made[-1]], len(text) + len(made) - 1, table, True)
            for text, made, table in zip(texts, tokens, tables, strict=True)
        ]
        for made, row in zip(tokens, runner.execute(step), strict=True):
            made.append(int(row.argmax()))
    assert tokens == [reference(text, count) for text in texts]


# ---- choosing the backend, and where it cannot run ------------------------------------------------------


def test_triton_is_chosen_when_asked_for_and_auto_never_takes_it_on_the_cpu():
    assert (not torch.cuda.is_available()) == triton_attention.INTERPRETED
    if not torch.cuda.is_available():
        assert choose_backend("triton", CPU, torch.float32, 16) == "triton"
        assert choose_backend("triton", CPU, torch.bfloat16, 16) == "triton"
        with pytest.raises(AttentionBackendUnavailable, match="has none"):
            choose_backend("triton", torch.device("cuda"), torch.bfloat16, 16)
    assert choose_backend("auto", CPU, torch.float32, 16) == "paged-cpu"
    assert choose_backend("auto", CPU, torch.bfloat16, 16) == "gather"
    with pytest.raises(AttentionBackendUnavailable, match=r"not torch.int8"):
        choose_backend("triton", CPU, torch.int8, 16)


def test_without_the_interpreter_or_without_triton_the_module_imports_and_says_why_not():
    script = (
        "import importlib, sys, torch\n"
        "module = importlib.import_module('workers.models.triton_attention')\n"
        "print(module.unavailable_reason(torch.device('cpu'), torch.float32))\n"
        "del sys.modules['workers.models.triton_attention']\n"
        "sys.modules['triton'] = None\n"
        "module = importlib.import_module('workers.models.triton_attention')\n"
        "print(module.unavailable_reason(torch.device('cpu'), torch.float32))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    installed, missing = run.stdout.splitlines()
    assert "on the CPU only under its interpreter (TRITON_INTERPRET=1" in installed
    assert missing.startswith("triton is not installed")


def test_flash_varlen_asks_torch_for_one_split_where_its_varlen_attn_takes_a_count(monkeypatch):
    """pytorch #194167: varlen_attn's automatic split-KV corrupts the paged path's output."""
    import torch.nn.attention.varlen as varlen

    asked = []

    def with_num_splits(*args, num_splits=None, **kwargs):
        asked.append(num_splits)
        return reference_varlen_attn(*args, **kwargs)

    step = make_step([(1, 13), (3, 0)], 4, 2, 8, 4, torch.float32, padding_seqs=0, padding_rows=0)
    plan = flash_varlen_module.FlashVarlenPlan(step.inputs, 4, CPU)
    for kernel in (with_num_splits, reference_varlen_attn):  # and a torch whose varlen_attn has no num_splits
        monkeypatch.setattr(varlen, "varlen_attn", kernel)
        plan.attend(step.query, step.key, step.value, step.layer_kv, 0.3, None)
    assert asked == [1]


# ---- on the GPU ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_compiled_kernel_on_cuda_matches_the_reference_and_replays_from_a_cuda_graph(dtype):
    """Fails, not skips, where CUDA is present and the kernel cannot run there."""
    cuda = torch.device("cuda")
    assert unavailable_reason(cuda, dtype) is None, unavailable_reason(cuda, dtype)
    for sequences, window, splits in [(MIXED, None, 1), (MIXED, 24, 1), (LONG, None, 8), (LONG, 40, 4)]:
        step = make_step(sequences, 8, 2, 128, 16, dtype, seed=splits).to(cuda)
        assert_matches(step, attended(step, 0.088, window, splits), 0.088, window, against_gather=False)
    steps = replayed_steps(dtype)
    buffers = FixedBuffers(steps[0], 64, 48, cuda)
    buffers.load(steps[0])
    buffers.attend(0.088, 5, 768)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buffers.attend(0.088, 5, 768)
    for step in steps:
        buffers.load(step)
        graph.replay()
        buffers.check(step)
