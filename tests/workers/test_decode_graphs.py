"""The fixed-shape decode step that CUDA graphs capture, run eagerly on CPU: the same logits and the
same KV as the runner's own decode step, padding rows confined to the padding block, and greedy
tokens equal to `transformers` generate through the engine."""

import asyncio

import pytest
import torch

from tests.workers.conftest import prefilled, prompts
from tests.workers.test_engine import run_all
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.main import build_engine
from workers.models.step import StepInput
from workers.runner.decode_graphs import DecodeGraphs, DecodeGraphSpec, capture_batch_sizes, capture_widths
from workers.runner.model_loader import load_model
from workers.runner.model_runner import ModelRunner

BLOCK = 16


def test_captured_batch_sizes_and_widths_cover_every_step_up_to_the_limits():
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_batch_sizes(1) == [1]
    assert capture_widths(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert capture_widths(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_widths(1) == [1]


@pytest.fixture
def runner(tiny_model):
    return ModelRunner(tiny_model, num_blocks=64, block_size=BLOCK)


def _padded_runner(model, max_batch: int, max_blocks: int, num_blocks: int = 64) -> ModelRunner:
    """A runner that pads its decode steps as for CUDA graphs and runs them eagerly."""
    spec = DecodeGraphSpec(max_batch, max_blocks, capture=False)
    return ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK, decode_graphs=spec)


def test_only_one_token_decode_steps_within_the_captured_shapes_are_covered(runner):
    graphs = DecodeGraphs(runner, DecodeGraphSpec(max_batch=4, max_blocks=2, capture=False))
    decode = StepInput([5], 31, [0, 1], True)
    assert graphs.covers([decode] * 4)
    assert not graphs.covers([])
    assert not graphs.covers([decode] * 5)  # more rows than captured
    assert not graphs.covers([StepInput([5], 32, [0, 1, 2], True)])  # a third block
    assert not graphs.covers([decode, StepInput([5, 6], 0, [3], True)])  # a prompt chunk
    assert not graphs.covers([StepInput([5], 31, [0, 1], False)])


def test_a_padded_step_gives_the_logits_and_kv_of_the_runners_own_step(runner, tiny_model):
    lengths = [5, 9, 40, 14, 70]  # 5 rows padded to 8; widths 1 to 5 blocks padded to 8
    decoding = prefilled(runner, lengths)
    eager = runner.execute(decoding)
    eager_kv = runner.kv.clone()

    padded_runner = _padded_runner(tiny_model, max_batch=8, max_blocks=8)
    prefilled(padded_runner, lengths)
    before = padded_runner.kv.clone()
    padded = padded_runner.execute(decoding)

    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)  # other GEMM shapes, other rounding
    used = slice(0, runner.num_blocks)
    torch.testing.assert_close(padded_runner.kv[:, :, used], eager_kv[:, :, used], rtol=1e-4, atol=1e-4)
    padding = runner.padding_block
    assert not torch.equal(padded_runner.kv[:, :, padding], before[:, :, padding])


def test_the_logits_returned_stay_the_callers_after_the_next_step(tiny_model):
    runner = _padded_runner(tiny_model, max_batch=2, max_blocks=1)
    decoding = prefilled(runner, [5, 9])
    first = runner.execute(decoding)
    kept = first.clone()
    runner.execute([StepInput([7], 6, decoding[0].block_ids, True), StepInput([8], 10, decoding[1].block_ids, True)])
    assert torch.equal(first, kept)


async def test_greedy_tokens_through_padded_decode_steps_match_generate(tiny_model, executor, reference, monkeypatch):
    runner = _padded_runner(tiny_model, max_batch=8, max_blocks=16, num_blocks=256)
    engine = Engine(runner, EngineConfig(num_kv_blocks=256, token_budget=64), StopCriteria(frozenset(), 1024), executor)
    task = asyncio.get_running_loop().create_task(engine.run())
    graphs = runner.decode_graphs
    padded_steps = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs: padded_steps.append(len(inputs)) or run(inputs))
    batch = prompts([3, 9, 16, 17, 31, 48, 70, 100, 130, 5])  # ten at once: steps of more than 8 run eagerly
    counts = [12, 20, 8, 15, 10, 18, 9, 14, 11, 25]
    try:
        outputs, _ = await run_all(engine, batch, counts)
    finally:
        task.cancel()
    assert outputs == [reference(p, n) for p, n in zip(batch, counts, strict=True)]
    assert len(padded_steps) > 5 and len(set(padded_steps)) > 3


def test_a_cpu_worker_decodes_eagerly_over_a_pool_with_one_padding_block(executor):
    loaded = load_model("diptych-tiny", "builtin:diptych-tiny")
    engine = build_engine(loaded, EngineConfig(kv_cache_mib=4, cuda_graphs=True), executor)
    runner = engine.runner
    assert runner.decode_graphs is None
    assert engine.kv.num_blocks == runner.num_blocks == runner.padding_block == runner.kv.shape[2] - 1
