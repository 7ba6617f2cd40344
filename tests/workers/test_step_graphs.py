"""Every step through the runner's persistent buffers and the padded shapes that CUDA graphs capture, run
eagerly on the CPU with the triton kernel under Triton's interpreter: the same logits and the same KV as
the gather backend's own steps for any mix of prompt chunks and decoding rows, padding rows confined to
the padding block, block-table rows written only where they grew, and greedy tokens equal to
`transformers` generate through the engine."""

import asyncio
import itertools
import random

import pytest
import torch

from tests.workers.conftest import prompts
from tests.workers.test_engine import run_all
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.models.step import StepInput
from workers.runner.decode_graphs import DecodeGraphSpec
from workers.runner.model_runner import ModelRunner
from workers.runner.step_buffers import StepBuffers
from workers.runner.step_graphs import capture_row_counts

BLOCK = 16
NUM_BLOCKS = 48


def test_captured_row_counts_pad_a_step_of_32_rows_or_more_by_a_quarter_at_most():
    counts = capture_row_counts(512)
    assert counts[:11] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert counts[-1] == 512 and 96 in counts and 288 in counts
    past_32 = counts[counts.index(32) :]
    assert all(later - earlier <= earlier // 4 for earlier, later in itertools.pairwise(past_32))
    assert capture_row_counts(6) == [1, 2, 4, 6]


def _graph_runner(model, max_seqs=4, max_blocks=8, max_tokens=128) -> ModelRunner:
    spec = DecodeGraphSpec(max_seqs, max_blocks, capture=False, max_tokens=max_tokens)
    return ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, decode_graphs=spec, attention="triton")


def _steps(seed: int) -> list[list[StepInput]]:
    """Three steps of four requests on scattered blocks: prompt chunks (one crossing block boundaries, one
    continuing its prompt), then a mix of chunks and decoding rows, then decoding rows only."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    tables = [blocks[0:6], blocks[6:10], blocks[10:13], blocks[13:20]]
    texts = prompts([70, 40, 30, 90], salt=seed)
    first = [
        StepInput(texts[0][:37], 0, tables[0], False),
        StepInput(texts[1][:40], 0, tables[1], True),
        StepInput(texts[2][:1], 0, tables[2], True),
        StepInput(texts[3][:20], 0, tables[3], False),
    ]
    second = [
        StepInput(texts[0][37:70], 37, tables[0], True),
        StepInput([11], 40, tables[1], True),
        StepInput([12], 1, tables[2], True),
        StepInput(texts[3][20:90], 20, tables[3], True),
    ]
    starts = [70, 41, 2, 90]
    third = [
        StepInput([13 + n], start, table, True) for n, (start, table) in enumerate(zip(starts, tables, strict=True))
    ]
    return [first, second, third]


def test_padded_steps_of_any_mix_give_the_logits_and_kv_of_the_gather_backend(tiny_model):
    reference = ModelRunner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, attention="gather")
    runner = _graph_runner(tiny_model)
    graphed = []
    run = runner.step_graphs.run
    runner.step_graphs.run = lambda inputs, rows: graphed.append(rows) or run(inputs, rows)
    before = runner.kv.clone()
    for step in _steps(seed=1):
        expected = reference.execute(step)
        got = runner.execute(step)
        torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)
    assert graphed == [112, 112, 4]  # 98 rows, 105, 4
    used = slice(0, NUM_BLOCKS)
    torch.testing.assert_close(runner.kv[:, :, used], reference.kv[:, :, used], rtol=2e-4, atol=2e-4)
    padding = runner.padding_block
    assert not torch.equal(runner.kv[:, :, padding], before[:, :, padding])  # the padding rows wrote there only


def test_a_step_beyond_the_captured_shapes_runs_eagerly_with_the_same_logits(tiny_model):
    reference = ModelRunner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, attention="gather")
    runner = _graph_runner(tiny_model, max_seqs=2, max_blocks=4, max_tokens=32)
    steps = _steps(seed=2)
    assert all(runner.step_graphs.rows_for(step) is None for step in steps[:2])  # 4 inputs, 2 captured
    assert runner.step_graphs.rows_for(steps[2][:2]) is None  # 6 blocks needed, 4 held
    for step in steps:
        torch.testing.assert_close(runner.execute(step), reference.execute(step), rtol=2e-4, atol=2e-4)


def test_block_table_rows_are_written_only_where_a_requests_table_grew():
    buffers = StepBuffers(
        max_tokens=8, max_seqs=2, max_blocks=4, block_size=4, padding_block=9, device=torch.device("cpu")
    )
    table_a, table_b = [3], [5, 6]
    first = [StepInput([1, 2, 3], 0, [3], True, table=table_a), StepInput([4], 5, [5, 6], True, table=table_b)]
    view = buffers.load(first, rows=6)
    assert view.block_table.tolist() == [[3, 9, 9, 9], [5, 6, 9, 9]]
    assert view.query_start.tolist() == [0, 3, 4] and view.seq_lens.tolist() == [3, 6]
    assert view.slots.tolist() == [12, 13, 14, 25, 36, 36]  # block 6 slot 1, then the padding block's first slot
    assert view.token_ids.tolist() == [1, 2, 3, 4, 0, 0] and view.sample_rows.tolist() == [2, 3]

    view.block_table[0, 1:] = 7  # what only a rewrite of the row would undo
    table_a.append(object())  # the same request's table, grown by one block
    grown = [StepInput([8], 4, [3, 8], True, table=table_a)]
    view = buffers.load(grown)
    assert view.block_table[0].tolist() == [3, 8, 7, 7]  # its new id written, the rest left as it was
    assert view.query_start.tolist() == [0, 1, 1] and view.seq_lens.tolist() == [5, 0]

    other = [StepInput([9], 4, [2, 1], True, table=[2, 1])]  # another request in that row: written whole
    assert buffers.load(other).block_table[0].tolist()[:2] == [2, 1]


async def test_greedy_tokens_through_padded_steps_of_every_mix_match_generate(tiny_model, executor, reference):
    spec = DecodeGraphSpec(4, 16, capture=False, max_tokens=48)
    runner = ModelRunner(tiny_model, num_blocks=128, block_size=BLOCK, decode_graphs=spec, attention="triton")
    engine = Engine(
        runner,
        EngineConfig(num_kv_blocks=128, token_budget=48, max_running=4),
        StopCriteria(frozenset(), 1024),
        executor,
    )
    task = asyncio.get_running_loop().create_task(engine.run())
    graphed: list[bool] = []
    run = runner.step_graphs.run
    runner.step_graphs.run = lambda inputs, rows: (
        graphed.append(any(len(s.token_ids) > 1 for s in inputs)) or run(inputs, rows)
    )
    batch = prompts([3, 20, 33, 70, 9, 51])  # six at once: four run, chunked by the 48-token budget
    counts = [6, 9, 5, 7, 8, 4]
    try:
        outputs, _ = await run_all(engine, batch, counts)
    finally:
        task.cancel()
    assert outputs == [reference(p, n) for p, n in zip(batch, counts, strict=True)]
    assert True in graphed and False in graphed  # steps with prompt chunks replayed, and decode-only ones


@pytest.mark.parametrize("attention", ["gather", "paged-cpu"])
def test_other_backends_keep_decode_graphs(tiny_model, attention):
    spec = DecodeGraphSpec(4, 8, capture=False, max_tokens=64)
    runner = ModelRunner(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK, decode_graphs=spec, attention=attention)
    assert runner.step_graphs is None and runner.decode_graphs is not None
