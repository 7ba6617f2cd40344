"""Tokens that arrive together go to the client together: over a colocated worker that decodes
speculatively (the model drafting for itself, so that each step gives a request several tokens), the
gateway sends each step's tokens of a request as one response, and the answer is still transformers'
greedy one, token for token, its text the tokenizer's, its usage and its metrics one per token."""

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from prometheus_client import REGISTRY

from diptych_common.worker_credential import WorkerSecret
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.fleet.channels import Channels
from gateway.planning.tokenization import tokenizer_for
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL, in_process_gateway
from tests.workers.conftest import prompts, reference, tiny_model, wait_until  # noqa: F401 - the workers' fixtures
from tests.workers.serving import SECRET, Worker
from tests.workers.test_gateway_sampling_controls import ControlPlaneKeepingKeys
from workers.engine.core import EngineConfig
from workers.serving.server import Role
from workers.spec_decode.config import SpecConfig

WORKER_ID = "colocated-0"
DRAFTING = SpecConfig("draft", num_draft_tokens=3, draft_model=f"builtin:{MODEL}")
METADATA = (("authorization", f"Bearer {API_KEY}"),)
COUNT = 40


@asynccontextmanager
async def speculative_gateway(tmp_path, tiny_model):  # noqa: F811 - the fixture, passed on
    """An in-process gateway over one colocated worker that drafts with the served model itself: greedy
    drafts are all accepted, so a step gives a request up to four tokens."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        config = EngineConfig(num_kv_blocks=128, token_budget=64, speculative=DRAFTING)
        worker = Worker(Role.COLOCATED, tiny_model, pool, allow_shm=False, config=config)
        await worker.start()
        entry = {"id": WORKER_ID, "role": "colocated", "model": MODEL, "region": "local", "address": worker.address}
        channels = Channels(WorkerSecret(SECRET))
        try:
            control_plane = ControlPlaneKeepingKeys(workers=[entry | {"state": "ready"}])
            async with in_process_gateway(tmp_path, control_plane, channels=channels, mode=ServingMode.COLOCATED) as gw:
                assert await wait_until(lambda: gw.path.board.is_fresh(WORKER_ID), timeout=10)
                yield gw
        finally:
            await channels.close()
            await worker.stop()


async def generate(gateway, prompt: list[int], **options) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=inference_pb2.TokenIds(ids=prompt), temperature=0, **options
    )
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    return [response async for response in stub.Generate(request, metadata=METADATA, timeout=60)]


def gaps_observed() -> float:
    return REGISTRY.get_sample_value("diptych_gateway_inter_token_latency_seconds_count", {"model": MODEL}) or 0.0


async def test_a_steps_tokens_go_out_in_one_response_and_the_answer_is_generates(
    tmp_path,
    tiny_model,  # noqa: F811
    reference,  # noqa: F811
):
    prompt = prompts([24], salt=31)[0]
    gaps_before = gaps_observed()
    async with speculative_gateway(tmp_path, tiny_model) as gateway:
        responses = await generate(gateway, prompt, max_tokens=COUNT, ignore_eos=True)
    token_ids = [token for response in responses for token in response.token_ids]
    assert token_ids == reference(prompt, COUNT)
    assert len(responses) < COUNT / 2, [len(r.token_ids) for r in responses]  # steps of several tokens
    assert max(len(response.token_ids) for response in responses) > 1
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    assert "".join(r.text for r in responses) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert responses[-1].usage.completion_tokens == COUNT
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert gaps_observed() - gaps_before == COUNT - 1  # one inter-token gap per token after the first


async def test_a_stop_string_inside_a_step_ends_the_answer_there_and_bills_what_went_out(
    tmp_path,
    tiny_model,  # noqa: F811
    reference,  # noqa: F811
):
    prompt = prompts([24], salt=31)[0]
    expected = reference(prompt, COUNT)
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    whole = tokenizer.decode(expected, skip_special_tokens=True)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    # the tokens up to the one whose text completes the stop string: those, and only those, are delivered
    cut = next(k for k in range(1, COUNT + 1) if stop in tokenizer.decode(expected[:k], skip_special_tokens=True))
    async with speculative_gateway(tmp_path, tiny_model) as gateway:
        responses = await generate(gateway, prompt, max_tokens=COUNT, ignore_eos=True, stop=[stop])
        billed = {event["phase"]: event["tokens"] for _, event in gateway.journal.oldest(10)}
    token_ids = [token for response in responses for token in response.token_ids]
    assert token_ids == expected[:cut]
    assert "".join(r.text for r in responses) == whole[: whole.index(stop)]
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == cut == billed["decode"]


async def stream_texts(gateway, body: dict, headers: dict) -> list[dict]:
    async with gateway.http.post("/v1/completions", json=body | {"stream": True}, headers=headers) as response:
        raw = (await response.read()).decode()
    return [json.loads(line[len("data: ") :]) for line in raw.split("\n\n") if line.startswith("data: {")]


async def test_an_answer_sent_in_steps_is_the_same_over_http_whole_streamed_and_stored_under_a_key(
    tmp_path,
    tiny_model,  # noqa: F811
    reference,  # noqa: F811
):
    """The HTTP front takes the same outputs: a stream's chunks and a whole answer hold the same text and
    count every token; under an idempotency key the stream keeps its outputs, and the answer stored for
    the key is the whole one."""
    prompt = prompts([24], salt=32)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": COUNT, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = tokenizer_for(f"builtin:{MODEL}").decode(reference(prompt, COUNT), skip_special_tokens=True)
    async with speculative_gateway(tmp_path, tiny_model) as gateway:
        async with gateway.http.post("/v1/completions", json=body, headers=headers) as response:
            whole = await response.json()
        chunks = await stream_texts(gateway, body, headers | {"Idempotency-Key": "batches-1"})
        stored = gateway.control_plane.results["batches-1"]
    assert whole["choices"][0]["text"] == text and whole["usage"]["completion_tokens"] == COUNT
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == text
    assert len(chunks) < COUNT / 2
    assert stored["text"] == text and stored["tokenIds"] == reference(prompt, COUNT)
    assert stored["usage"]["completionTokens"] == COUNT
