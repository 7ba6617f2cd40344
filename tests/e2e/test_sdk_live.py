"""The SDK against the live local stack: real gateway, workers and control plane (the `live` fixture)."""

import asyncio
import datetime
import json
import uuid

import pytest

import diptych
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 64, 23]
LONG_OUTPUT = 1000  # with the prompt, all of diptych-tiny's context: a stream left early is far from its end


def client_for(live, mode: str = "split", **options) -> diptych.Client:
    return diptych.Client(
        api_key=live.api_key, base_url=live.gateways[mode], admin_url=live.stack.control_plane_url, **options
    )


def usage_events(live, request_id: str) -> list[dict]:
    with live.rest() as rest:
        return rest.get("/usage-events", params={"request_id": request_id}).json()["data"]


def roll_up_usage(live, control_plane_shell, *request_ids: str) -> None:
    """Waits until the requests' usage reached the ledger, then runs the periodic rollup job now."""
    for request_id in request_ids:
        assert wait_for(lambda rid=request_id: len(usage_events(live, rid)) >= 2), f"no usage for {request_id}"
    control_plane_shell("from controlplane.billing.tasks import roll_up_usage; roll_up_usage()")


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_completion_chat_and_models(live, mode):
    with client_for(live, mode) as client:
        (model,) = [model for model in client.models.list() if model.id == MODEL]
        assert model.has_chat_template and model.context_length > 0

        completion = client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=0, ignore_eos=True
        )
        assert completion.finish_reason == "length" and len(completion.token_ids) == 8
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(PROMPT_IDS), 8)
        assert completion.usage.cached_tokens >= 0 and completion.id

        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4, seed=7, priority="batch"
        )
        assert chat.usage.prompt_tokens > 0 and 1 <= chat.usage.completion_tokens <= 4
        assert chat.id and chat.id != completion.id


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_stream_carries_one_request_id_and_ends_with_usage(live, mode):
    with (
        client_for(live, mode) as client,
        client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=12, ignore_eos=True, stream=True
        ) as stream,
    ):
        chunks = list(stream)
    assert {chunk.id for chunk in chunks} == {stream.request_id} and stream.request_id
    assert [chunk.finish_reason for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "length" and stream.usage == last.usage
    assert last.usage.completion_tokens == sum(len(chunk.token_ids) for chunk in chunks) == 12
    assert last.usage.prompt_tokens > 0 and last.usage.cached_tokens >= 0


def test_leaving_a_stream_early_cancels_generation(live):
    watch = live.watch_cancellation(LONG_OUTPUT)
    with (
        client_for(live) as client,
        client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=LONG_OUTPUT, ignore_eos=True, stream=True
        ) as stream,
    ):
        received = [chunk for chunk, _ in zip(stream, range(3), strict=False)]
    assert len(received) == 3
    watch.assert_freed(prompt_tokens=len(PROMPT_IDS))

    def decode_event():
        return next((event for event in usage_events(live, stream.request_id) if event["phase"] == "decode"), None)

    decode = wait_for(decode_event)
    assert decode is not None and 3 <= decode["tokens"] < LONG_OUTPUT


async def test_async_stream_and_early_exit(live):
    async with diptych.AsyncClient(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        completion = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=5, ignore_eos=True)
        assert completion.usage.completion_tokens == 5
        watch = live.watch_cancellation(LONG_OUTPUT)
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=LONG_OUTPUT, ignore_eos=True, stream=True
        )
        async with stream:
            async for chunk in stream:
                assert chunk.id == stream.request_id
                break
    assert stream.usage is None
    await asyncio.to_thread(watch.assert_freed, len(PROMPT_IDS))


def test_a_repeated_idempotency_key_is_one_request_billed_once(live):
    key = f"order-{uuid.uuid4()}"
    with client_for(live) as client:
        fields = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
        first = client.completions.create(**fields, idempotency_key=key)
        again = client.completions.create(**fields, idempotency_key=key)
        other = client.completions.create(**fields)
    assert first.id == again.id != other.id
    assert first.token_ids == again.token_ids
    events = wait_for(lambda: len(usage_events(live, first.id)) >= 2 and usage_events(live, first.id))
    assert sorted(event["phase"] for event in events) == ["decode", "prefill"]
    assert sum(event["tokens"] for event in events if event["phase"] == "decode") == 4


def test_openai_extras_against_the_live_gateway_and_control_plane(live):
    with client_for(live) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=4,
            extra_headers={"x-trace-id": "sdk-live"},
            extra_body={"seed": 7},
        )
        chat = raw.parse()
        assert raw.request_id == raw.headers["request-id"] == chat.id
        (choice,) = chat.choices
        assert choice.message is not None and (choice.message.role, choice.message.content) == ("assistant", chat.text)
        assert json.loads(chat.to_json())["usage"]["prompt_tokens"] == chat.usage.prompt_tokens > 0
        models = client.models.with_raw_response.list()
        assert MODEL in [model.id for model in models.parse()]

        created = [client.admin.api_keys.create(name=f"sdk-page-{n}", scopes=["inference"]) for n in range(3)]
        walked = [key.id for key in client.admin.api_keys.list(limit=2)]
        assert {key.id for key in created} <= set(walked) and len(walked) == len(set(walked))
        raw_keys = client.admin.api_keys.with_raw_response.list(limit=1)
        assert raw_keys.headers["content-type"].startswith("application/json") and len(raw_keys.parse().data) == 1
        for key in created:
            client.admin.api_keys.revoke(key.id)


def test_admin_sub_client_against_the_control_plane(live, control_plane_shell):
    today = datetime.datetime.now(datetime.UTC).date()
    with client_for(live) as client:
        created = client.admin.api_keys.create(name="sdk-live", scopes=["inference"])
        assert created.key and created.key.startswith(created.prefix) and created.scopes == ["inference"]
        listed = {key.id: key for key in client.admin.api_keys.list(limit=200).data}
        assert listed[created.id].key is None and listed[created.id].revoked_at is None
        assert client.admin.api_keys.retrieve(created.id).name == "sdk-live"

        with diptych.Client(
            api_key=created.key, base_url=live.gateways["split"], admin_url=live.stack.control_plane_url
        ) as user:
            completion = user.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, ignore_eos=True)
            with pytest.raises(diptych.PermissionDeniedError) as refused:
                user.admin.billing.current()
            assert refused.value.status_code == 403

        roll_up_usage(live, control_plane_shell, completion.id)
        rows = client.admin.usage.daily(start=today, end=today, group_by="api_key")
        billed = len(PROMPT_IDS) + completion.usage.completion_tokens
        assert sum(row.tokens for row in rows if row.key == created.id) == billed
        phases = client.admin.usage.daily(start=today - datetime.timedelta(days=1), end=today, group_by="phase")
        assert {row.key for row in phases} <= {"prefill", "cached_prefill", "decode"}
        assert any(row.tokens for row in phases)
        by_model = client.admin.usage.daily(start=today, end=today, group_by="model")
        assert {row.key for row in by_model} == {MODEL}

        billing = client.admin.billing.current()
        assert billing.period_start <= today <= billing.period_end and billing.currency == "usd"
        assert billing.amount_to_date_micros > 0 and billing.projected_micros >= billing.amount_to_date_micros
        assert isinstance(client.admin.invoices.list().data, list)

        revoked = client.admin.api_keys.revoke(created.id)
        assert revoked.revoked_at is not None

        def refused_by_gateway():
            with diptych.Client(api_key=created.key, base_url=live.gateways["split"], max_retries=0) as user:
                try:
                    user.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1)
                except diptych.AuthenticationError:
                    return True
            return False

        assert wait_for(refused_by_gateway, seconds=10, interval=0.5)
        with pytest.raises(diptych.NotFoundError):
            client.admin.api_keys.retrieve("key_does_not_exist")


async def test_async_admin_sub_client(live):
    async with diptych.AsyncClient(api_key=live.api_key, admin_url=live.stack.control_plane_url) as client:
        billing = await client.admin.billing.current()
        keys = await client.admin.api_keys.list()
    assert billing.currency == "usd" and keys.total >= 1


def test_openai_parameters_and_streaming_responses_against_the_live_stack(live):
    """`max_completion_tokens`, `user` and `stream_options` reach the real gateway; `with_streaming_response`
    reads the real control plane's answer before its body; the per-call options travel."""
    with client_for(live, max_retries=0) as client:
        label = f"sdk-user-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, str]] = [{"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=3, user=label, service_tier="auto", metadata={}
        )
        assert 1 <= chat.usage.completion_tokens <= 3
        assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.cached_tokens
        with client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=2, stream=True, stream_options={"include_usage": True}
        ) as stream:
            assert list(stream)[-1].usage is not None
        page = client.models.list()
        assert isinstance(page, diptych.Page) and MODEL in [model.id for model in page.data]

        created = client.admin.api_keys.create(name="sdk-streamed", scopes=["inference"], idempotency_key=label)
        again = client.admin.api_keys.create(name="sdk-streamed", scopes=["inference"], idempotency_key=label)
        assert again.id == created.id  # the control plane acted once on the key
        with client.admin.api_keys.with_streaming_response.retrieve(created.id, timeout=10) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
            assert response.parse().id == created.id
        assert client.admin.api_keys.revoke(created.id, extra_headers={"X-Trace-Id": label}).revoked_at is not None
