"""Every body parameter of the OpenAI-compatible endpoints is honoured or refused with a 400 naming it
(docs/api-parameters.md): unknown keys, OpenAI parameters with no equivalent here, and the checks of n,
prompt_cache_key, user, best_of, stream_options and max_completion_tokens. A request that passes the door
reaches the request path (here a fleet with no workers: 503), one that is refused never does.

Also the defaults that depend on the endpoint: a chat without max_tokens may run to the end of the
context, a completion to 16 tokens; and the rate limiter reserves a bounded estimate for the former.
"""

import json

import grpc
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.accounts.auth import Caller, RateLimits
from gateway.accounts.limits import RateLimiter
from gateway.core.pipeline import ESTIMATED_OUTPUT_TOKENS, reserved_output_tokens
from gateway.planning.validation import DEFAULT_MAX_TOKENS, plan_generation
from gateway.types import ChatMessage, GatewayError, GenerationRequest
from tests.gateway.harness import (
    API_KEY,
    CONTEXT_LENGTH,
    MODEL,
    assert_openai_error_shape,
    in_process_gateway,
    post_json,
)

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hi"}


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


async def refused(gateway, url: str, body: dict) -> dict:
    status, payload = await post_json(gateway, url, json.dumps(body).encode())
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert gateway.path.runs == 0
    return payload["error"]


async def accepted(gateway, url: str, body: dict) -> None:
    """Past every check at the door: the request reached the request path (no workers here: a 503, or
    an error event on a stream that had started)."""
    runs = gateway.path.runs
    status, payload = await post_json(gateway, url, json.dumps(body).encode())
    assert status == (200 if body.get("stream") else 503), payload
    assert gateway.path.runs == runs + 1


@pytest.mark.parametrize(
    ("url", "base", "key"),
    [
        (CHAT_URL, CHAT, "frobnicate"),
        (CHAT_URL, CHAT, "prompt"),  # a completions parameter
        (CHAT_URL, CHAT, "echo"),
        (CHAT_URL, CHAT, "best_of"),
        (CHAT_URL, CHAT, "suffix"),
        (COMPLETIONS_URL, COMPLETION, "messages"),  # a chat parameter
        (COMPLETIONS_URL, COMPLETION, "response_format"),
        (COMPLETIONS_URL, COMPLETION, "store"),
        (COMPLETIONS_URL, COMPLETION, "Temperature"),
    ],
)
async def test_a_key_the_endpoint_does_not_know_is_refused_by_name(gateway, url, base, key):
    error = await refused(gateway, url, {**base, key: 1})
    assert error["param"] == key
    assert repr(key) in error["message"] and url in error["message"] and "remove it" in error["message"]


@pytest.mark.parametrize(
    ("url", "base", "key", "value", "message"),
    [
        (CHAT_URL, CHAT, "audio", {"voice": "alloy", "format": "wav"}, "text only"),
        (CHAT_URL, CHAT, "modalities", ["text", "audio"], "text only"),
        (CHAT_URL, CHAT, "prediction", {"type": "content", "content": "x"}, "predicted outputs"),
        (CHAT_URL, CHAT, "web_search_options", {}, "web search"),
        (CHAT_URL, CHAT, "store", True, "not stored"),
        (CHAT_URL, CHAT, "metadata", {"a": "b"}, "not stored"),
        (CHAT_URL, CHAT, "service_tier", "flex", "priority"),
        (CHAT_URL, CHAT, "reasoning_effort", "low", "reasons"),
        (CHAT_URL, CHAT, "verbosity", "low", "verbosity"),
        (CHAT_URL, CHAT, "safety_identifier", "abc", "user"),
        (CHAT_URL, CHAT, "functions", [{"name": "f"}], "tools"),
        (CHAT_URL, CHAT, "function_call", "auto", "tool_choice"),
        (COMPLETIONS_URL, COMPLETION, "echo", True, "echo"),
        (COMPLETIONS_URL, COMPLETION, "suffix", "end", "suffix"),
        (COMPLETIONS_URL, COMPLETION, "best_of", 3, "best_of must equal n"),
        (COMPLETIONS_URL, {**COMPLETION, "n": 2}, "best_of", 3, "best_of must equal n"),
        (COMPLETIONS_URL, COMPLETION, "n", 17, "n must be an integer from 1 to 16"),
        (COMPLETIONS_URL, COMPLETION, "n", 0, "n must be an integer from 1 to 16"),
        (CHAT_URL, CHAT, "n", "2", "n must be an integer"),
        (CHAT_URL, CHAT, "n", True, "n must be an integer"),
        (CHAT_URL, CHAT, "prompt_cache_key", 7, "prompt_cache_key must be a string"),
        (CHAT_URL, CHAT, "prompt_cache_key", "x" * 256, "prompt_cache_key must be 1 to 255"),
        (CHAT_URL, CHAT, "user", "someone@example.com", "user must be"),
        (CHAT_URL, CHAT, "user", 5, "user must be"),
        (CHAT_URL, CHAT, "stream_options", {"include_usage": True}, "only allowed when stream is true"),
        (CHAT_URL, {**CHAT, "stream": True}, "stream_options", {"include_obfuscation": True}, "only include_usage"),
        (CHAT_URL, {**CHAT, "max_tokens": 5}, "max_completion_tokens", 6, "differ"),
        (CHAT_URL, CHAT, "max_completion_tokens", -1, "max_completion_tokens must be an integer"),
    ],
)
async def test_a_parameter_not_honoured_or_out_of_range_is_refused_by_name(gateway, url, base, key, value, message):
    error = await refused(gateway, url, {**base, key: value})
    assert error["param"] == key, error
    assert message in error["message"]


@pytest.mark.parametrize(
    ("url", "base", "extra"),
    [
        (CHAT_URL, CHAT, {"audio": None, "prediction": None, "web_search_options": None, "metadata": None}),
        (CHAT_URL, CHAT, {"store": False, "metadata": {}, "modalities": ["text"], "service_tier": "auto"}),
        (CHAT_URL, CHAT, {"service_tier": "default", "reasoning_effort": None, "functions": None}),
        (CHAT_URL, CHAT, {"n": 3, "prompt_cache_key": "session-1", "user": "user_4f2a"}),
        (CHAT_URL, CHAT, {"stream": True, "stream_options": {"include_usage": True}}),
        (CHAT_URL, CHAT, {"max_tokens": 5, "max_completion_tokens": 5}),
        (CHAT_URL, CHAT, {"stream_options": None, "user": None}),
        (COMPLETIONS_URL, COMPLETION, {"echo": False, "suffix": None, "best_of": 1}),
        (COMPLETIONS_URL, COMPLETION, {"n": 2, "best_of": 2}),
        (COMPLETIONS_URL, COMPLETION, {"max_completion_tokens": 4, "top_k": 3, "ignore_eos": True}),
    ],
)
async def test_parameters_at_their_defaults_or_honoured_pass_the_door(gateway, url, base, extra):
    await accepted(gateway, url, {**base, **extra})


async def test_grpc_refuses_n_out_of_range_and_a_long_prompt_cache_key(gateway):
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    auth = (("authorization", f"Bearer {API_KEY}"),)
    for fields, message in (
        ({"n": 0}, "n must be from 1 to 16"),
        ({"n": 17}, "n must be from 1 to 16"),
        ({"prompt_cache_key": "k" * 256}, "prompt_cache_key must be 1 to 255"),
    ):
        request = inference_pb2.GenerateRequest(model=MODEL, prompt="hi", **fields)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stub.Generate(request, metadata=auth, timeout=10):
                pass
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert message in raised.value.details()
    assert gateway.path.runs == 0


async def test_user_is_kept_as_the_request_s_label_in_usage():
    from gateway.openai_api.requests import to_generation_request

    request = to_generation_request({**CHAT, "user": "user_4f2a"}, True, "")
    assert request.client_request_id == "user_4f2a"


async def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context_a_completion_16(gateway):
    registry = gateway.pipeline.registry
    chat = await plan_generation(GenerationRequest(MODEL, chat=[ChatMessage("user", "hi")]), registry, "org")
    assert chat.sampling.max_tokens == CONTEXT_LENGTH - len(chat.prompt_token_ids)
    completion = await plan_generation(GenerationRequest(MODEL, prompt="hi"), registry, "org")
    assert completion.sampling.max_tokens == DEFAULT_MAX_TOKENS
    explicit = await plan_generation(
        GenerationRequest(MODEL, chat=[ChatMessage("user", "hi")], max_tokens=7), registry, "o"
    )
    assert explicit.sampling.max_tokens == 7


async def test_a_chat_without_max_tokens_reserves_an_estimate_and_settles_the_real_count(gateway):
    registry = gateway.pipeline.registry
    request = GenerationRequest(MODEL, chat=[ChatMessage("user", "hi")], n=2)
    plan = await plan_generation(request, registry, "org")
    assert reserved_output_tokens(plan, request) == 2 * ESTIMATED_OUTPUT_TOKENS
    explicit = GenerationRequest(MODEL, chat=[ChatMessage("user", "hi")], max_tokens=600, n=2)
    assert reserved_output_tokens(await plan_generation(explicit, registry, "org"), explicit) == 1200

    # An output limit far below the context: reserving the whole context would refuse every ordinary chat.
    limiter = RateLimiter()
    single = GenerationRequest(MODEL, chat=[ChatMessage("user", "hi")])
    single_plan = await plan_generation(single, registry, "org")
    who = Caller("org_audit", "key_audit", key_limits=RateLimits(output_tokens_per_minute=600))
    with pytest.raises(GatewayError, match="lower max_tokens"):
        await limiter.admit(who, 5, single_plan.sampling.max_tokens)
    reservation = await limiter.admit(who, 5, reserved_output_tokens(single_plan, single))
    await limiter.settle(reservation, 20)  # a short answer: the unused estimate comes back
    reservation = await limiter.admit(who, 5, reserved_output_tokens(single_plan, single))
    await limiter.settle(reservation, 500)  # a long one: what it used beyond the estimate is taken
    with pytest.raises(GatewayError, match="rate limit reached") as raised:
        await limiter.admit(who, 5, ESTIMATED_OUTPUT_TOKENS)
    assert raised.value.retry_after_ms is not None


@pytest.mark.parametrize("url", ["/v1/embeddings", "/v1/moderations", "/v1/images/generations"])
async def test_an_endpoint_not_served_is_a_404_in_openai_shape(gateway, url):
    status, payload = await post_json(gateway, url, json.dumps({"model": MODEL, "input": "hi"}).encode())
    assert status == 404, payload
    assert_openai_error_shape(payload)
    assert gateway.path.runs == 0
