"""The serving engine on the live platform: live load with the prefix summary, prefix hits billed as
cached tokens, and exact greedy output for concurrent prompts that share a prefix."""

import asyncio
import random

import grpc
import httpx

import diptych
from diptych_common.prefix_hash import block_hashes
from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import worker_credential
from tests.e2e.test_generation import generate_reference


def test_workers_publish_their_kv_memory_at_once(live):
    for name in ("prefill-0", "decode-0", "colocated-0"):
        with grpc.insecure_channel(live.workers[name]["address"]) as channel:
            watch = worker_pb2_grpc.WorkerStub(channel).WatchLoad(
                worker_pb2.LoadRequest(), timeout=5, metadata=worker_credential(live.stack)
            )
            load = next(watch)
            watch.cancel()
        assert load.block_size == 16 and 0 < load.kv_blocks_free <= load.kv_blocks_total
        assert not load.draining


def test_a_repeated_prompt_hits_the_prefix_cache_and_is_billed_as_cached(live, reference):
    model, _ = reference
    prompt = [random.Random(41).randrange(3, 512) for _ in range(100)]
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        first = client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=6, temperature=0)
        second = client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=6, temperature=0)
    expected = generate_reference(model, prompt, 6)
    assert first.token_ids == second.token_ids == expected
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 96  # six full blocks of 16; the last 4 tokens are computed
    load = live.worker_load("prefill-0")
    # The worker names the blocks under the organization's salt (its public id), as the gateway routes.
    assert set(block_hashes(prompt, 16, live.credentials.organization_id)) <= set(load.prefix_cache.block_hashes)
    assert not set(block_hashes(prompt, 16)) & set(load.prefix_cache.block_hashes)


async def test_concurrent_prompts_sharing_a_prefix_match_generate(live, reference):
    model, _ = reference
    rng = random.Random(5)
    prefix = [rng.randrange(3, 512) for _ in range(80)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 16, 40, 90)]
    async with diptych.AsyncClient(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        completions = await asyncio.gather(
            *(client.completions.create(model="diptych-tiny", prompt=p, max_tokens=10, temperature=0) for p in prompts)
        )
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == generate_reference(model, prompt, 10), f"prompt of {len(prompt)} tokens"


def test_a_worker_exports_its_engine_steps(live):
    def steps() -> float:
        text = httpx.get(live.worker_metrics_urls["colocated-0"], timeout=5).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith('diptych_worker_step_seconds_count{role="colocated"}')
        )

    before = steps()
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["colocated"]) as client:
        client.completions.create(model="diptych-tiny", prompt=[5] * 40, max_tokens=5, temperature=0)
    # one step computes the prompt and samples the first token, then one step per further token
    assert steps() - before >= 5
    text = httpx.get(live.worker_metrics_urls["colocated-0"], timeout=5).text
    assert 'diptych_worker_active_sequences{role="colocated"' in text
