"""The prefill and decode engines in process, on the built-in model."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from diptych_common.builtin import DIPTYCH_TINY
from workers.decode_engine import DecodeEngine
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.prefill_engine import PrefillEngine
from workers.sampling import SamplingParams, StopCriteria

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(load_model(DIPTYCH_TINY.name, f"builtin:{DIPTYCH_TINY.name}"))


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def prompts(lengths):
    return [[(7 * n + i) % 500 + 3 for i in range(n)] for n in lengths]


async def test_prefill_batches_concurrent_prompts_within_the_token_budget(runner, executor):
    engine = PrefillEngine(runner, executor, token_budget=100)
    task = asyncio.create_task(engine.run())
    batch = prompts([40, 40, 40, 40, 40, 150])
    results = await asyncio.gather(*(engine.submit(p, GREEDY) for p in batch))
    task.cancel()
    # Two 40-token prompts fit a 100-token budget; the 150-token prompt runs alone.
    assert engine.batches_run == 4
    alone_logits, alone_kvs = runner.prefill(batch[:1])
    assert results[0].first_token_id == int(alone_logits[0].argmax())
    assert [r.kv.length for r in results] == [len(p) for p in batch]


async def test_decode_frees_every_sequence_whatever_ends_it(runner, executor):
    engine = DecodeEngine(runner, executor, StopCriteria(frozenset(), 1024))
    task = asyncio.create_task(engine.run())
    batch = prompts([3, 30, 60, 90])
    logits, kvs = runner.prefill(batch)
    finishing = [
        engine.add(f"r{i}", len(p), int(logits[i].argmax()), kvs[i], GREEDY) for i, p in enumerate(batch[:2])
    ]
    aborted = engine.add("r2", len(batch[2]), 5, kvs[2], SamplingParams(temperature=0.0, max_tokens=500))
    never_started = engine.add("r3", len(batch[3]), 5, kvs[3], GREEDY)
    engine.abort("r3")
    for seq in finishing:
        while not (await seq.outputs.get()).finished:
            pass
    await aborted.outputs.get()
    engine.abort("r2")
    for _ in range(100):
        if engine.kv_tokens_held == 0:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert engine.kv_tokens_held == 0
    assert engine.active_sequences == 0 and engine.queue_depth == 0
    assert all(len(seq.output_token_ids) == GREEDY.max_tokens for seq in finishing)
    assert never_started.leaving and never_started.outputs.empty()
