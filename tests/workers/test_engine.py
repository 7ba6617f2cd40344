"""The engine on the built-in model: greedy tokens equal `transformers` generate whatever the batching,
and every KV block is free again however requests end."""

import asyncio

import pytest
import torch

from tests.workers.conftest import prompts
from workers.engine import RequestRejected
from workers.request import BATCH, EngineRequest, ImportedKv
from workers.sampling import SamplingParams


def greedy(count: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)


async def collect(handle) -> list[int]:
    tokens = []
    while True:
        output = await handle.outputs.get()
        if isinstance(output, Exception):
            raise output
        tokens.append(output.token_id)
        if output.finished or handle.request.prefill_only:
            return tokens


async def settle(engine) -> None:
    for _ in range(200):
        if not engine.scheduler.running and not engine.num_waiting:
            return
        await asyncio.sleep(0.01)


def assert_all_blocks_free(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(block.ref_count == 0 for block in engine.kv.pool.blocks)
    assert not engine.kv.block_tables and not engine._handles


async def run_all(engine, batch, counts, **request_options):
    handles = [
        engine.add(EngineRequest(f"r{i}", p, greedy(n), **request_options)) for i, (p, n) in enumerate(zip(batch, counts))
    ]
    return await asyncio.gather(*(collect(h) for h in handles)), handles


async def test_many_concurrent_mixed_length_prompts_match_generate(make_engine, reference):
    engine = make_engine(token_budget=64)
    batch = prompts([3, 9, 16, 17, 31, 48, 70, 100, 130, 5])
    counts = [12, 20, 8, 15, 10, 18, 9, 14, 11, 25]
    outputs, _ = await run_all(engine, batch, counts)
    for prompt, count, output in zip(batch, counts, outputs):
        assert output == reference(prompt, count)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_requests_joining_a_running_batch_match_generate(make_engine, reference):
    engine = make_engine(token_budget=48)
    early = engine.add(EngineRequest("early", prompts([40])[0], greedy(30)))
    first = await early.outputs.get()
    late_prompts = prompts([7, 90], salt=1)
    late = [engine.add(EngineRequest(f"late{i}", p, greedy(10))) for i, p in enumerate(late_prompts)]
    rest = await asyncio.gather(collect(early), *(collect(h) for h in late))
    assert [first.token_id] + rest[0] == reference(prompts([40])[0], 30)
    for prompt, output in zip(late_prompts, rest[1:]):
        assert output == reference(prompt, 10)


async def test_prompts_longer_than_the_budget_are_chunked_and_still_exact(make_engine, reference):
    engine = make_engine(token_budget=32)
    batch = prompts([200, 150, 4])
    outputs, _ = await run_all(engine, batch, [6, 6, 6])
    assert outputs == [reference(p, 6) for p in batch]
    assert engine.steps_run >= 350 // 32


async def test_a_shared_prefix_is_computed_once_and_reported(make_engine, reference):
    engine = make_engine(token_budget=512)
    prefix = prompts([64], salt=3)[0]
    first = prefix + [11, 12, 13]
    await run_all(engine, [first], [5])
    second = prefix + [21, 22, 23, 24, 25]
    outputs, handles = await run_all(engine, [second], [7])
    assert outputs[0] == reference(second, 7)
    assert handles[0].request.num_cached_tokens == 64
    assert engine.kv.hits_tokens == 64 and engine.kv.queried_tokens == len(first) + len(second)
    # A prompt that is wholly cached still computes its last token.
    outputs, handles = await run_all(engine, [prefix], [4])
    assert outputs[0] == reference(prefix, 4)
    assert handles[0].request.num_cached_tokens == 48
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_a_tiny_kv_pool_preempts_and_recomputes_exactly(make_engine, reference):
    engine = make_engine(num_kv_blocks=12, token_budget=64, enable_prefix_caching=False)
    batch = prompts([40, 35, 50, 20, 45], salt=5)
    counts = [40, 40, 30, 40, 30]
    outputs, handles = await run_all(engine, batch, counts)
    assert sum(h.request.num_preemptions for h in handles) > 0
    for prompt, count, output in zip(batch, counts, outputs):
        assert output == reference(prompt, count)
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_interactive_requests_are_admitted_before_batch_ones(make_engine):
    engine = make_engine(max_running=1, token_budget=512)
    batch_handles = [engine.add(EngineRequest(f"b{i}", prompts([10], salt=i)[0], greedy(3), priority=BATCH)) for i in range(2)]
    interactive = engine.add(EngineRequest("i0", prompts([10], salt=9)[0], greedy(3)))
    finished_order = []

    async def track(handle):
        await collect(handle)
        finished_order.append(handle.request.request_id)

    await asyncio.gather(*(track(h) for h in [*batch_handles, interactive]))
    assert finished_order.index("i0") < finished_order.index("b1")


class CaptureStage:
    """Stands where a KV transfer stands: receives the blocks of a prefill-only request as computed."""

    def __init__(self, layout, num_blocks: int) -> None:
        self.blocks_staged = 0
        self.data = torch.zeros(layout.num_layers, 2, num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
        self.writes = []

    def write_blocks(self, runner, block_ids, first_block):
        chunk = torch.empty(self.data.shape[0], 2, len(block_ids), *self.data.shape[3:])
        runner.read_blocks(block_ids, chunk)
        self.data[:, :, first_block:first_block + len(block_ids)] = chunk
        self.writes.append((first_block, len(block_ids)))

    def wait_sent(self):
        pass


async def test_kv_staged_during_a_chunked_prefill_continues_exactly_elsewhere(make_engine, reference):
    """What a prefill and a decode worker do, minus the wire: a chunked prefill stages its blocks as
    they are computed; another engine decodes from them."""
    prefill = make_engine(token_budget=32)
    decode = make_engine()
    prompt = prompts([77], salt=7)[0]
    stage = CaptureStage(prefill.runner.layout, 5)
    handle = prefill.add(EngineRequest("p", prompt, greedy(10), prefill_only=True, kv_stage=stage))
    first = await collect(handle)
    assert stage.writes == [(0, 2), (2, 2), (4, 1)]  # full blocks as each chunk completes, the tail last
    request = EngineRequest(
        "d", prompt, greedy(10), output_token_ids=list(first), imported_kv=ImportedKv(77, [(0, stage.data)])
    )
    tokens = first + await collect(decode.add(request))
    assert tokens == reference(prompt, 10)
    await settle(decode)
    assert_all_blocks_free(decode)


async def test_every_block_is_free_after_cancels_failures_and_finishes(make_engine, monkeypatch):
    engine = make_engine(num_kv_blocks=40, token_budget=64)
    batch = prompts([30, 60, 90, 20, 45, 70], salt=11)
    handles = [engine.add(EngineRequest(f"r{i}", p, greedy(25))) for i, p in enumerate(batch)]
    engine.abort("r5")  # before it ran
    await handles[1].outputs.get()
    engine.abort("r1")  # while decoding
    original = engine.runner.execute
    calls = 0

    def failing_once(inputs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected failure")
        return original(inputs)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    results = await asyncio.gather(*(collect(h) for h in handles[:1] + handles[2:5]), return_exceptions=True)
    assert any(isinstance(r, RuntimeError) for r in results)
    await settle(engine)
    assert_all_blocks_free(engine)
    # The engine keeps serving after a failed step.
    assert len(await collect(engine.add(EngineRequest("after", batch[0], greedy(5))))) == 5


async def test_requests_that_can_never_fit_are_rejected_with_the_reason(make_engine):
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(RequestRejected, match="KV memory"):
        engine.add(EngineRequest("big", prompts([60])[0], greedy(20)))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add(EngineRequest("empty", [], greedy(2)))
    assert_all_blocks_free(engine)


async def test_seeded_sampling_continues_after_a_migration(make_engine):
    engine = make_engine()
    prompt = prompts([20], salt=2)[0]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    whole = await collect(engine.add(EngineRequest("a", prompt, seeded)))
    # A migrated request re-runs prefill on prompt + the 3 tokens already sent and continues at index 3.
    migrated = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, tokens_already_generated=3)
    rest = await collect(engine.add(EngineRequest("b", prompt + whole[:3], migrated)))
    assert rest == whole[3:]


async def test_an_identical_prompt_of_another_organization_gets_no_cached_tokens(make_engine, reference):
    engine = make_engine(token_budget=512)
    secret = prompts([256], salt=4)[0]
    await run_all(engine, [secret + [1]], [2], cache_salt="org-a")
    outputs, handles = await run_all(engine, [secret + [2]], [3], cache_salt="org-b")
    assert handles[0].request.num_cached_tokens == 0
    assert outputs[0] == reference(secret + [2], 3)
    _, handles = await run_all(engine, [secret + [3]], [2], cache_salt="org-a")
    assert handles[0].request.num_cached_tokens == 256   # the same organization still hits
