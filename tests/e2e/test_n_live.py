"""n > 1 choices, prompt_cache_key and the chat default of max_tokens through the whole live stack (split
and colocated): greedy choices equal transformers generate, seeded choices differ from each other and
replay exactly, the prompt's KV cache is computed once and shared (the prefill worker computes only the
last, partial block for each extra choice, and the decode worker receives only that block), the usage the
client sees and the ledger bills agree, an idempotency key replays every choice, and the official
`openai` client gets every choice, whole and streamed."""

import asyncio

import grpc
import httpx
import openai
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.conftest import tokens_computed
from tests.e2e.test_generation import generate_reference
from tests.e2e.test_metering import usage_events

MODEL = "diptych-tiny"
MODES = ["split", "colocated"]


def prompt_of(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


async def generate(live, mode: str, **fields) -> tuple[dict[int, list[int]], inference_pb2.Usage, str, dict]:
    """Every choice's tokens, the request's usage, its id and each choice's finish reason, over gRPC."""
    target = live.gateways[mode].removeprefix("grpc://")
    tokens: dict[int, list[int]] = {}
    finish: dict[int, int] = {}
    usage, request_id = None, ""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(model=MODEL, **fields)
        auth = (("authorization", f"Bearer {live.api_key}"),)
        async for response in stub.Generate(request, metadata=auth, timeout=120):
            assert response.index not in finish, "a choice went on after its last response"
            tokens.setdefault(response.index, []).extend(response.token_ids)
            request_id = response.request_id
            if response.finish_reason:
                finish[response.index] = response.finish_reason
            if response.HasField("usage"):
                assert usage is None, "usage came twice"
                usage = response.usage
    assert usage is not None and set(finish) == set(tokens)
    return tokens, usage, request_id, finish


def block_size(live, mode: str) -> int:
    size = live.worker_load("prefill-0" if mode == "split" else "colocated-0").block_size
    assert size, "the worker publishes no block size"
    return size


@pytest.mark.parametrize("mode", MODES)
async def test_greedy_choices_equal_transformers_generate_and_share_the_prompt_s_kv(live, reference, mode):
    model, _ = reference
    prompt = prompt_of(101 + len(mode), 40)
    block = block_size(live, mode)
    shared = (len(prompt) - 1) // block * block  # full blocks: the last token is always computed
    computing = "prefill-0" if mode == "split" else "colocated-0"
    computed_before = tokens_computed(live.worker_metrics_urls[computing])
    tokens, usage, request_id, _ = await generate(
        live, mode, prompt_token_ids=inference_pb2.TokenIds(ids=prompt), max_tokens=10, temperature=0, n=2
    )
    expected = generate_reference(model, prompt, 10)
    assert tokens == {0: expected, 1: expected}
    assert usage.prompt_tokens == len(prompt)  # counted once
    assert usage.completion_tokens == 2 * len(expected)
    assert usage.cached_tokens == 0  # choice 0's: a fresh prompt
    # The prompt is billed once, by choice 0; choice 1 reused its blocks and bills only its output.
    assert (usage.prefill.tokens, usage.prefill.cached_tokens) == (len(prompt), 0)
    if mode == "split":
        # The prefill worker computed the prompt once, then only the last block for choice 1.
        computed = tokens_computed(live.worker_metrics_urls[computing]) - computed_before
        assert computed == len(prompt) + (len(prompt) - shared)

    live.wait_until_usage_sent(mode)
    first = {e["phase"]: e for e in usage_events(live, request_id, expected=2)}
    second = {e["phase"]: e for e in usage_events(live, f"{request_id}-c1", expected=1)}
    assert {p: (e["tokens"], e["cached_tokens"]) for p, e in first.items()} == {
        "prefill": (len(prompt), 0),
        "decode": (len(expected), 0),
    }
    assert {p: (e["tokens"], e["cached_tokens"]) for p, e in second.items()} == {"decode": (len(expected), 0)}
    assert second["decode"]["worker_id"] == first["decode"]["worker_id"]
    assert first["prefill"]["kv_bytes"] == usage.prefill.kv_bytes


@pytest.mark.parametrize("mode", MODES)
async def test_seeded_choices_differ_from_each_other_and_replay_exactly(live, mode):
    prompt = prompt_of(202, 24)
    fields = {"prompt_token_ids": inference_pb2.TokenIds(ids=prompt), "max_tokens": 12, "temperature": 1.0}
    tokens, usage, _, _ = await generate(live, mode, seed=1234, n=3, **fields)
    again, _, _, _ = await generate(live, mode, seed=1234, n=3, **fields)
    assert again == tokens
    assert len({tuple(t) for t in tokens.values()}) == 3, tokens
    alone, _, _, _ = await generate(live, mode, seed=1234, **fields)
    assert alone == {0: tokens[0]}  # choice 0 is the request's own seed
    other, _, _, _ = await generate(live, mode, seed=1235, n=3, **fields)
    assert other != tokens
    assert usage.completion_tokens == sum(len(t) for t in tokens.values())


async def test_concurrent_n_requests_keep_their_choices_apart(live, reference):
    model, _ = reference
    prompts = [prompt_of(300 + i, 17 + 9 * i) for i in range(3)]
    results = await asyncio.gather(
        *(
            generate(live, "split", prompt_token_ids=inference_pb2.TokenIds(ids=p), max_tokens=8, temperature=0, n=3)
            for p in prompts
        )
    )
    for prompt, (tokens, usage, _, _) in zip(prompts, results, strict=True):
        expected = generate_reference(model, prompt, 8)
        assert tokens == {0: expected, 1: expected, 2: expected}
        assert usage.completion_tokens == 3 * len(expected)


@pytest.fixture(params=MODES)
def client(live, request):
    with openai.OpenAI(api_key=live.api_key, base_url=live.http_urls[request.param], max_retries=0) as client:
        yield client


def test_the_openai_client_gets_every_choice_whole_and_streamed(client, reference):
    _, tokenizer = reference
    messages = [{"role": "user", "content": "two answers please"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 2 * len(tokenizer.encode(chat.choices[0].message.content)) or (
        chat.choices[0].finish_reason == "stop"
    )

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    assert set(finishes) == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    completion = client.completions.create(model=MODEL, prompt="once upon", max_tokens=6, temperature=0, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.text for c in completion.choices}) == 1
    assert completion.usage.prompt_tokens == len(tokenizer.encode("once upon"))


def test_an_idempotency_key_replays_every_choice(live):
    headers = {"Authorization": f"Bearer {live.api_key}", "Idempotency-Key": "n-choices-replay-1"}
    body = {"model": MODEL, "prompt": "replay me", "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3}
    url = f"{live.http_urls['split']}/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=60)
    second = httpx.post(url, json=body, headers=headers, timeout=60)
    assert first.status_code == second.status_code == 200, first.text
    assert second.headers.get("Idempotent-Replayed") == "true"
    assert second.json()["choices"] == first.json()["choices"]
    assert [c["index"] for c in first.json()["choices"]] == [0, 1, 2]
    assert second.json()["usage"] == first.json()["usage"]


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context_or_its_end_of_sequence(live, reference):
    _, _tokenizer = reference
    with openai.OpenAI(api_key=live.api_key, base_url=live.http_urls["colocated"], max_retries=0) as client:
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go on"}], temperature=0
        )
        completion = client.completions.create(model=MODEL, prompt="go on", temperature=0)
    choice = chat.choices[0]
    if choice.finish_reason == "length":
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == live_context_length(live)
    else:
        assert choice.finish_reason == "stop"
    assert completion.usage.completion_tokens <= 16  # a completion's default stays 16
    assert completion.usage.completion_tokens == 16 or completion.choices[0].finish_reason == "stop"


def live_context_length(live) -> int:
    with grpc.insecure_channel(live.gateways["colocated"].removeprefix("grpc://")) as channel:
        models = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {live.api_key}"),), timeout=10
        )
    return next(m.context_length for m in models.models if m.id == MODEL)


@pytest.mark.parametrize("mode", MODES)
def test_the_sdk_gets_every_choice_whole_and_streamed(live, reference, mode):
    import diptych

    model, _ = reference
    prompt = prompt_of(505, 30)
    expected = generate_reference(model, prompt, 6)
    with diptych.Client(api_key=live.api_key, base_url=live.gateways[mode]) as client:
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3)
        with client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2, stream=True
        ) as stream:
            chunks = list(stream)
    assert [(c.index, c.token_ids) for c in completion.choices] == [(0, expected), (1, expected), (2, expected)]
    assert completion.token_ids == expected and completion.usage.completion_tokens == 3 * len(expected)
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        streamed.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert streamed == {0: expected, 1: expected}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * len(expected)
    assert stream.usage == chunks[-1].usage
