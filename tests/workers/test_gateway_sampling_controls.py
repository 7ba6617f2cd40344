"""logprobs, penalties and logit_bias through the whole gateway (the OpenAI-compatible HTTP API, the gRPC
API and the SDK) over real workers served in this process, split (a prefill worker handing its KV to a
decode worker) and colocated, and across a decode worker's death mid-stream. The reference is a loop
over `transformers`' logits with the same bias and penalties (`test_sampling_controls.controlled_reference`)."""

import json
from contextlib import asynccontextmanager

import pytest

import diptych
from diptych_common.worker_credential import WorkerSecret
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.core.logprobs import token_bytes
from gateway.fleet.channels import Channels
from gateway.metrics import MIGRATIONS
from gateway.planning.tokenization import encode_chat, tokenizer_for
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, in_process_gateway, post_json
from tests.workers.conftest import prompts, wait_until
from tests.workers.serving import SECRET, Worker
from tests.workers.test_sampling_controls import LOGPROB_TOLERANCE, controlled_reference, controls
from workers.serving.server import Role
from workers.structured.compiler import GrammarCompiler

AUTH = (("authorization", f"Bearer {API_KEY}"),)
BIAS = {"17": 3.0, "40": -100.0}
OPTIONS = {"presence_penalty": 0.6, "frequency_penalty": 1.2, "logit_bias": BIAS}


class ControlPlaneKeepingKeys(ControlPlaneInMemory):
    """The in-memory control plane, also keeping idempotency keys' results (as the SDK always sends one)."""

    def __init__(self, workers: list[dict]) -> None:
        super().__init__(workers=workers)
        self.results: dict[str, dict] = {}

    async def claim_idempotency_key(self, body: dict) -> dict:
        stored = self.results.get(body["key"])
        return {"outcome": "claimed"} if stored is None else {"outcome": "completed", "response": stored}

    async def complete_idempotency_key(self, body: dict) -> dict:
        self.results[body["key"]] = body["response"]
        return {}

    async def release_idempotency_key(self, body: dict) -> dict:
        return {}


def params(count: int, top: int):
    bias = tuple(sorted((int(token), value) for token, value in BIAS.items()))
    return controls(
        count, presence_penalty=0.6, frequency_penalty=1.2, logit_bias=bias, logprobs=True, top_logprobs=top
    )


@asynccontextmanager
async def gateway_over(
    tmp_path, tiny_model, executor, roles: dict[str, Role], mode: ServingMode, grammars: GrammarCompiler | None = None
):
    """An in-process gateway in `mode` over fresh workers of the tiny model (id -> role); `grammars`: the
    workers' grammar compiler (structured outputs and tools)."""
    workers = {
        worker_id: Worker(role, tiny_model, executor, allow_shm=False, grammars=grammars)
        for worker_id, role in roles.items()
    }
    for worker in workers.values():
        await worker.start()
    entries = [
        {"id": worker_id, "role": str(roles[worker_id]), "model": MODEL, "region": "local"}
        | {"address": worker.address, "state": "ready"}
        for worker_id, worker in workers.items()
    ]
    channels = Channels(WorkerSecret(SECRET))
    try:
        async with in_process_gateway(tmp_path, ControlPlaneKeepingKeys(entries), channels=channels, mode=mode) as gw:
            assert await wait_until(lambda: all(gw.path.board.is_fresh(w) for w in workers), timeout=10)
            yield gw, workers
    finally:
        await channels.close()
        for worker in workers.values():  # those the test stopped are gone from it
            await worker.stop()


SPLIT = {"prefill-0": Role.PREFILL, "decode-0": Role.DECODE, "decode-1": Role.DECODE}
COLOCATED = {"colocated-0": Role.COLOCATED}


def assert_chat_logprobs_match(content: list[dict], expected, top: int, tokenizer) -> None:
    assert len(content) == len(expected)
    for entry, (logprob, best) in zip(content, expected, strict=True):
        assert entry["logprob"] == pytest.approx(logprob, abs=LOGPROB_TOLERANCE)
        assert [alt["token"] for alt in entry["top_logprobs"]] == [tokenizer.decode([t]) for t, _ in best]
        assert len(entry["top_logprobs"]) == top
        for alt, (_, value) in zip(entry["top_logprobs"], best, strict=True):
            assert alt["logprob"] == pytest.approx(value, abs=LOGPROB_TOLERANCE)


async def stream_events(gateway, url: str, body: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with gateway.http.post(url, json={**body, "stream": True}, headers=headers) as response:
        assert response.status == 200
        raw = (await response.read()).decode()
    lines = [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("mode", ["split", "colocated"])
async def test_chat_logprobs_and_penalties_over_http_equal_the_reference(tmp_path, tiny_model, executor, mode):
    roles, serving = (SPLIT, ServingMode.SPLIT) if mode == "split" else (COLOCATED, ServingMode.COLOCATED)
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    messages = [{"role": "user", "content": "tell me about the sea and the sky"}]
    prompt = encode_chat(tokenizer, messages)
    expected, expected_logprobs = controlled_reference(tiny_model, prompt, 12, params(12, 3))
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= OPTIONS | {"logprobs": True, "top_logprobs": 3}
    async with gateway_over(tmp_path, tiny_model, executor, roles, serving) as (gateway, _):
        status, whole = await post_json(gateway, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, whole
        choice = whole["choices"][0]
        assert choice["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
        content = choice["logprobs"]["content"]
        assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in expected]
        assert all(
            entry["bytes"] == token_bytes(tokenizer, t, entry["token"])
            for entry, t in zip(content, expected, strict=True)
        )
        assert_chat_logprobs_match(content, expected_logprobs, 3, tokenizer)
        # streamed: every token's logprobs, the first (prefill's) included, in the chunks' order
        chunks = await stream_events(gateway, "/v1/chat/completions", body)
        streamed = [
            entry for chunk in chunks for c in chunk["choices"] if c["logprobs"] for entry in c["logprobs"]["content"]
        ]
        assert_chat_logprobs_match(streamed, expected_logprobs, 3, tokenizer)
        # without logprobs asked for: none
        status, plain = await post_json(
            gateway, "/v1/chat/completions", json.dumps({**body, "logprobs": False, "top_logprobs": None}).encode()
        )
        assert status == 200 and plain["choices"][0]["logprobs"] is None


async def test_completion_logprobs_over_http_in_openai_shape(tmp_path, tiny_model, executor):
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    prompt = prompts([30], salt=21)[0]
    expected, expected_logprobs = controlled_reference(tiny_model, prompt, 10, params(10, 2))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    body |= OPTIONS | {"logprobs": 2}
    async with gateway_over(tmp_path, tiny_model, executor, SPLIT, ServingMode.SPLIT) as (gateway, _):
        status, whole = await post_json(gateway, "/v1/completions", json.dumps(body).encode())
        assert status == 200, whole
        logprobs = whole["choices"][0]["logprobs"]
        texts = [tokenizer.decode([t]) for t in expected]
        assert logprobs["tokens"] == texts
        for got, (wanted, _) in zip(logprobs["token_logprobs"], expected_logprobs, strict=True):
            assert got == pytest.approx(wanted, abs=LOGPROB_TOLERANCE)
        for top, (_, best), token in zip(logprobs["top_logprobs"], expected_logprobs, texts, strict=True):
            assert set(top) == {tokenizer.decode([t]) for t, _ in best} | {token}
        assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        chunks = await stream_events(gateway, "/v1/completions", body)
        streamed = [c["logprobs"] for chunk in chunks for c in chunk["choices"] if c["logprobs"]]
        assert [token for part in streamed for token in part["tokens"]] == texts
        assert [offset for part in streamed for offset in part["text_offset"]] == logprobs["text_offset"]


async def test_grpc_and_the_sdk_return_logprobs(tmp_path, tiny_model, executor):
    prompt = prompts([26], salt=22)[0]
    expected, expected_logprobs = controlled_reference(tiny_model, prompt, 8, params(8, 4))
    async with gateway_over(tmp_path, tiny_model, executor, SPLIT, ServingMode.SPLIT) as (gateway, _):
        call = inference_pb2_grpc.InferenceStub(gateway.channel).Generate(
            inference_pb2.GenerateRequest(
                model=MODEL,
                prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
                max_tokens=8,
                temperature=0.0,
                ignore_eos=True,
                presence_penalty=0.6,
                frequency_penalty=1.2,
                logit_bias={int(token): value for token, value in BIAS.items()},
                logprobs=True,
                top_logprobs=4,
            ),
            metadata=AUTH,
        )
        responses = [response async for response in call]
        assert [t for r in responses for t in r.token_ids] == expected
        entries = [entry for r in responses for entry in r.logprobs]
        assert [e.token_id for e in entries] == expected
        for entry, (wanted, best) in zip(entries, expected_logprobs, strict=True):
            assert entry.logprob == pytest.approx(wanted, abs=LOGPROB_TOLERANCE)
            assert [top.token_id for top in entry.top_logprobs] == [t for t, _ in best]
        async with diptych.AsyncClient(api_key=API_KEY, base_url=f"grpc://{gateway.grpc_target}") as client:
            asked = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "presence_penalty": 0.6,
                "frequency_penalty": 1.2,
                "logit_bias": BIAS,
                "logprobs": 4,
                "idempotency_key": "sampling-controls-1",
            }
            completion = await client.completions.create(**asked)
            replayed = await client.completions.create(**asked)
        assert replayed.logprobs == completion.logprobs  # an idempotent replay keeps them
        assert completion.token_ids == expected
        assert completion.logprobs is not None and [e.token_id for e in completion.logprobs] == expected
        for entry, (wanted, best) in zip(completion.logprobs, expected_logprobs, strict=True):
            assert entry.logprob == pytest.approx(wanted, abs=LOGPROB_TOLERANCE)
            assert [top.token_id for top in entry.top_logprobs] == [t for t, _ in best]


async def test_a_decode_worker_dying_mid_stream_keeps_penalties_and_logprobs_right(tmp_path, tiny_model, executor):
    """The stream moves to the other decode worker after some tokens: prefill re-runs on prompt + those
    tokens, which the penalties still count; tokens and logprobs equal an undisturbed run's."""
    prompt = prompts([40], salt=23)[0]
    count = 120
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
        max_tokens=count,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=0.6,
        frequency_penalty=1.2,
        logit_bias={int(token): value for token, value in BIAS.items()},
        logprobs=True,
        top_logprobs=2,
    )
    async with gateway_over(tmp_path, tiny_model, executor, SPLIT, ServingMode.SPLIT) as (gateway, workers):
        stub = inference_pb2_grpc.InferenceStub(gateway.channel)
        undisturbed = [r async for r in stub.Generate(request, metadata=AUTH)]
        migrations = MIGRATIONS._value.get()
        received, killed = [], None
        async for response in stub.Generate(request, metadata=AUTH):
            received.append(response)
            if killed is None and len(received) >= 8:
                killed = next(w for w in ("decode-0", "decode-1") if workers[w].engine.stats().running)
                await workers.pop(killed).stop()
    assert killed is not None
    assert MIGRATIONS._value.get() == migrations + 1
    tokens = [t for r in received for t in r.token_ids]
    assert tokens == [t for r in undisturbed for t in r.token_ids]
    assert len(tokens) == count
    pairs = zip([e for r in received for e in r.logprobs], [e for r in undisturbed for e in r.logprobs], strict=True)
    for got, wanted in pairs:
        assert got.logprob == pytest.approx(wanted.logprob, abs=LOGPROB_TOLERANCE)
        assert [t.token_id for t in got.top_logprobs] == [t.token_id for t in wanted.top_logprobs]
    # the undisturbed run is the reference's (penalties counted over the whole output)
    expected, _ = controlled_reference(tiny_model, prompt, 24, params(24, 2))
    assert tokens[:24] == expected
