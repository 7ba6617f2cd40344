"""Generation through the whole stack: SDK → gateway → prefill → KV hand-off → decode."""

import asyncio
import random

import pytest
import torch

import diptych

MODES = ["split", "colocated"]
PROMPT_LENGTHS = [1, 2, 5, 17, 40, 64, 100, 128, 170, 200]
MAX_TOKENS = 24


def generate_reference(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_tokens
        )
    return out[0, len(prompt_ids) :].tolist()


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("mode", MODES)
async def test_concurrent_greedy_output_equals_transformers_generate(live, reference, mode):
    model, _ = reference
    prompts = random_prompts(seed=7)
    async with diptych.AsyncClient(api_key=live.api_key, base_url=live.gateways[mode]) as client:
        completions = await asyncio.gather(
            *(
                client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                for prompt in prompts
            )
        )
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == generate_reference(model, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
        assert completion.usage.prompt_tokens == len(prompt)
        assert completion.usage.completion_tokens == len(completion.token_ids)


@pytest.mark.parametrize("mode", MODES)
def test_text_prompt_is_tokenized_as_the_model_tokenizer_does(live, reference, mode):
    model, tokenizer = reference
    prompt = "The quick brown fox jumps over the lazy dog, twice."
    prompt_ids = tokenizer(prompt)["input_ids"]
    with diptych.Client(api_key=live.api_key, base_url=live.gateways[mode]) as client:
        completion = client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.token_ids == generate_reference(model, prompt_ids, 12)


def test_stream_delivers_each_token_and_ends_with_usage(live, reference):
    model, _ = reference
    prompt = random_prompts(seed=3)[5]
    with (
        diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client,
        client.completions.create(
            model="diptych-tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True
        ) as stream,
    ):
        chunks = list(stream)
    token_ids = [t for chunk in chunks for t in chunk.token_ids]
    assert token_ids == generate_reference(model, prompt, 16)
    assert all(chunk.usage is None and chunk.finish_reason is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.usage.completion_tokens == len(token_ids)
    assert last.finish_reason in ("length", "stop")
    assert last.usage.prefill.worker_id == live.workers["prefill-0"]["id"]
    assert last.usage.decode.worker_id == live.workers["decode-0"]["id"]


def test_kv_cache_moves_between_workers_and_never_through_the_gateway(live):
    prompt = random_prompts(seed=11)[-1]  # 200 tokens
    # The KV cache moves in whole blocks (the last one partly filled) where the workers page it.
    block_size = live.worker_load("prefill-0").block_size or 1
    tokens_moved = -(-len(prompt) // block_size) * block_size
    kv_bytes = 4 * 2 * 2 * tokens_moved * 64 * 4  # layers × (K, V) × kv heads × tokens × head dim × float32
    gateway_before = live.gateway_metric("split", "diptych_gateway_worker_bytes_received_total")
    sent_before = live.worker_load("prefill-0").kv_bytes_sent
    received_before = live.worker_load("decode-0").kv_bytes_received
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        completion = client.completions.create(model="diptych-tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert completion.usage.prefill.kv_bytes == kv_bytes
    assert live.worker_load("prefill-0").kv_bytes_sent - sent_before == kv_bytes
    assert live.worker_load("decode-0").kv_bytes_received - received_before == kv_bytes
    gateway_bytes = live.gateway_metric("split", "diptych_gateway_worker_bytes_received_total") - gateway_before
    assert 0 < gateway_bytes < kv_bytes / 100


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_is_reproducible_across_modes_and_batches(live, mode):
    prompt = random_prompts(seed=5)[4]
    params = dict(model="diptych-tiny", prompt=prompt, max_tokens=20, temperature=0.9, top_p=0.95, top_k=50)
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as split:
        expected = split.completions.create(seed=1234, **params).token_ids
        other_seed = split.completions.create(seed=4321, **params).token_ids
    with diptych.Client(api_key=live.api_key, base_url=live.gateways[mode]) as client:
        assert client.completions.create(seed=1234, **params).token_ids == expected
    assert other_seed != expected


def test_stop_string_ends_the_output_before_it(live):
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        full = client.completions.create(model="diptych-tiny", prompt="Once upon a time", max_tokens=40, temperature=0)
        stop = full.text[10:13]
        assert len(stop) == 3
        stopped = client.completions.create(
            model="diptych-tiny", prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop]
        )
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.finish_reason == "stop"
    assert stopped.usage.completion_tokens < full.usage.completion_tokens


@pytest.mark.parametrize("mode", MODES)
def test_leaving_a_stream_early_frees_the_sequence_on_the_workers(live, mode):
    decode_worker = "decode-0" if mode == "split" else "colocated-0"
    max_tokens = 970  # with the prompt, all of diptych-tiny's context: the stream is left far from its end
    watch = live.watch_cancellation(max_tokens)
    with diptych.Client(api_key=live.api_key, base_url=live.gateways[mode]) as client:
        stream = client.completions.create(
            model="diptych-tiny", prompt=[5] * 50, max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True
        )
        with stream:
            for index, _ in enumerate(stream):
                if index == 3:
                    assert live.worker_load(decode_worker).active_sequences >= 1
                    break
    watch.assert_freed(prompt_tokens=50)
