"""OpenAI's chat parameters the gateway's API takes (`max_completion_tokens`, `user`, `metadata`, `stream_options`,
`service_tier`), mapped onto the gRPC contract or refused before sending where it cannot carry them; message
dicts built ahead of the call; `usage.prompt_tokens_details`; `models.list()`'s page and options. Against the
scripted gRPC server (a real channel)."""

from __future__ import annotations

import pytest
from sdk_scripted_server import tokens

import diptych
from diptych_proto.v1 import inference_pb2 as pb

HELLO = tokens(("Hel", [1, 2]), ("lo", [3]))
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client(server):
    server.servicer.script = [HELLO]
    with diptych.Client(api_key="k", base_url=server.base_url, timeout=30, max_retries=0) as client:
        yield client


def test_max_completion_tokens_is_the_contracts_max_tokens(server, client):
    client.chat.completions.create(model="m", messages=USER, max_completion_tokens=7)
    client.chat.completions.create(model="m", messages=USER, max_completion_tokens=5, max_tokens=5)
    client.completions.create(model="m", prompt="x", max_completion_tokens=3)
    assert [request.max_tokens for request in server.servicer.requests] == [7, 5, 3]


def test_user_labels_the_request(server, client):
    client.chat.completions.create(model="m", messages=USER, user="user-42")
    client.chat.completions.create(model="m", messages=USER)
    assert [request.request_id for request in server.servicer.requests] == ["user-42", ""]


def test_the_default_values_of_metadata_service_tier_and_stream_options_are_accepted(server, client):
    client.chat.completions.create(model="m", messages=USER, metadata={}, service_tier="auto")
    client.chat.completions.create(model="m", messages=USER, service_tier="default", metadata=None)
    with client.chat.completions.create(
        model="m", messages=USER, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}
    ) as stream:
        chunks = list(stream)
    assert chunks[-1].usage is not None and len(server.servicer.requests) == 3


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens and max_completion_tokens differ"),
        ({"user": "has spaces"}, "user must be 1 to 128 characters"),
        ({"user": "x" * 129}, "user must be 1 to 128 characters"),
        ({"metadata": {"topic": "a"}}, "metadata has nothing to label"),
        ({"service_tier": "flex"}, "service_tier must be one of auto, default"),
        ({"stream_options": {"include_usage": True}}, "only allowed with stream=True"),
        ({"stream": True, "stream_options": {"include_usage": False}}, "include_usage cannot be false"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats is not"),
        ({"stream": True, "stream_options": {"other": 1}}, "stream_options.other is not supported"),
        ({"extra_query": {"a": "b"}}, "gRPC calls have no query string"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role is 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\].content must be"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "tool_calls must be"),
        ({"messages": {"role": "user", "content": "x"}}, "messages must be a list"),
        ({"messages": ["hi"]}, r"messages\[0\] must be a mapping"),
    ],
)
def test_what_the_contract_cannot_carry_is_refused_before_sending(server, client, arguments, error):
    with pytest.raises(ValueError, match=error):
        client.chat.completions.create(**{"model": "m", "messages": USER, **arguments})
    assert server.servicer.requests == []


async def test_async_chat_takes_the_same_parameters(server):
    server.servicer.script = [HELLO]
    async with diptych.AsyncClient(api_key="k", base_url=server.base_url, max_retries=0) as client:
        await client.chat.completions.create(model="m", messages=USER, max_completion_tokens=2, user="u")
        with pytest.raises(ValueError, match="service_tier"):
            await client.chat.completions.create(model="m", messages=USER, service_tier="priority")  # type: ignore[arg-type]
    (request,) = server.servicer.requests
    assert (request.max_tokens, request.request_id) == (2, "u")


def test_messages_built_ahead_as_plain_dicts_and_text_parts(server, client):
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    client.chat.completions.create(model="m", messages=messages)
    (request,) = server.servicer.requests
    sent = [(m.role, m.content, m.tool_call_id) for m in request.chat.messages]
    assert sent == [("system", "Be brief.", ""), ("user", "Hello", ""), ("assistant", "", ""), ("tool", "42", "c1")]
    assert [(call.id, call.name) for call in request.chat.messages[2].tool_calls] == [("c1", "f")]


def test_usage_carries_openais_prompt_tokens_details(client):
    usage = client.chat.completions.create(model="m", messages=USER).usage
    assert usage.prompt_tokens_details == diptych.PromptTokensDetails(cached_tokens=1)
    assert usage.cached_tokens == usage.prompt_tokens_details.cached_tokens == 1  # the flat one stays
    assert usage.model_dump()["prompt_tokens_details"] == {"cached_tokens": 1}
    built = diptych.Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=2, total_tokens=4)
    assert built.prompt_tokens_details == diptych.PromptTokensDetails(cached_tokens=2)


def test_models_list_takes_the_per_call_options(server, client):
    server.servicer.models = [pb.Model(id="m", context_length=8)]
    page = client.models.list(extra_headers={"X-Trace-Id": "t"}, timeout=5)
    assert [model.id for model in page] == ["m"] and server.servicer.metadata[-1]["x-trace-id"] == "t"
    with pytest.raises(ValueError, match="ListModelsRequest has no field x"):
        client.models.list(extra_body={"x": 1})
    with pytest.raises(ValueError, match="no query string"):
        client.models.list(extra_query={"x": 1})
    assert len(server.servicer.metadata) == 1
