"""The OpenAI-compatible HTTP API, driven by the official `openai` client, unchanged, and by plain HTTP
for what the client hides (headers, the SSE stream, idempotency)."""

import time

import httpx
import openai
import pytest

from tests.e2e.test_generation import generate_reference, random_prompts
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"


@pytest.fixture(params=["split", "colocated"])
def client(live, request):
    with openai.OpenAI(api_key=live.api_key, base_url=live.http_urls[request.param], max_retries=0) as client:
        yield client


def test_models_lists_the_catalog(client):
    listed = client.models.with_raw_response.list()
    models = listed.parse()
    assert [m.id for m in models.data] == [MODEL]
    assert 0 < models.data[0].created <= time.time()  # when the catalog added it
    assert listed.headers["x-request-id"].startswith("req_")
    assert client.models.retrieve(MODEL).created == models.data[0].created


def test_completion_equals_transformers_generate_and_reports_usage(client, reference):
    model, _ = reference
    prompt = random_prompts(seed=21)[4]
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = completion.choices[0]
    expected = generate_reference(model, prompt, 12)
    assert choice.text == reference[1].decode(expected, skip_special_tokens=True)
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(expected)
    assert completion.usage.total_tokens == len(prompt) + len(expected)
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_completion(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6 or chat.choices[0].finish_reason == "stop"


def test_streaming_chat_with_include_usage_matches_the_whole_answer(client):
    messages = [{"role": "user", "content": "tell me about the cache"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_completion_without_usage(client, reference):
    model, tokenizer = reference
    prompt = random_prompts(seed=22)[3]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(
        generate_reference(model, prompt, 10), skip_special_tokens=True
    )
    assert all(c.usage is None for c in chunks)


def test_errors_are_openai_shaped(live):
    base_url = live.http_urls["split"]
    with (
        openai.OpenAI(api_key="dip_not-a-key", base_url=base_url, max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError) as raised,
    ):
        wrong.models.list()
    assert raised.value.body["code"] == "invalid_api_key"
    with openai.OpenAI(api_key=live.api_key, base_url=base_url, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as raised:
            client.completions.create(model="no-such-model", prompt="hi")
        assert raised.value.body["type"] == "not_found_error"
        assert "model 'no-such-model' does not exist" in raised.value.body["message"]
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="hi", temperature=3.5)
        assert raised.value.body["param"] == "temperature"
        assert raised.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="hi", n=17)
        assert raised.value.body["param"] == "n"
    response = httpx.post(
        f"{base_url}/completions", content=b"{not json", headers={"Authorization": f"Bearer {live.api_key}"}
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_an_idempotency_key_makes_a_retried_request_one_billed_request(live):
    headers = {"Authorization": f"Bearer {live.api_key}", "Idempotency-Key": f"retry-me-{time.time_ns()}"}
    body = {"model": MODEL, "prompt": "bill me once", "max_tokens": 4, "temperature": 0}
    first = httpx.post(f"{live.http_urls['split']}/completions", json=body, headers=headers, timeout=30)
    second = httpx.post(f"{live.http_urls['split']}/completions", json=body, headers=headers, timeout=30)
    assert "Idempotent-Replayed" not in first.headers and second.headers["Idempotent-Replayed"] == "true"
    first, second = first.json(), second.json()
    assert first["id"] == second["id"] and first["id"].startswith("exec_")
    assert (first["choices"], first["usage"]) == (second["choices"], second["usage"])
    with live.rest() as rest:

        def events() -> list[dict]:
            return rest.get("/usage-events", params={"request_id": first["id"]}).json()["data"]

        assert wait_for(lambda: len(events()) >= 2), "no usage for the request"
        live.wait_until_usage_sent("split")  # every event the gateway held has reached the ledger
        assert sorted(e["phase"] for e in events()) == ["decode", "prefill"]


def test_the_grpc_api_serves_health_and_reflection(live):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(live.gateways["split"].removeprefix("grpc://")) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "diptych.v1.Inference" in services
    assert httpx.get(live.http_urls["split"].removesuffix("/v1") + "/health", timeout=5).json() == {"status": "ok"}


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client):
    """guidellm and other benchmark clients ask for `stream_options.continuous_usage_stats`: every chunk
    then carries the running usage, and the last one agrees with the final usage chunk."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0
    final = chunks[-1].usage
    assert final.completion_tokens == 12 and counts[-2] == 12
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {final.prompt_tokens}
