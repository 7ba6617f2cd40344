"""The OpenAI-compatible request bodies, mapped into the gateway's GenerationRequest, and refusals; and the
same request over gRPC, mapped into the same GenerationRequest."""

import pytest

from diptych_proto.v1 import inference_pb2
from gateway.accounts.idempotency import fingerprint
from gateway.fleet.registry import Registry
from gateway.grpc_api.service import generation_request
from gateway.openai_api.requests import HttpError, to_generation_request
from gateway.planning.validation import plan_generation
from gateway.types import ChatMessage, GenerationRequest, Priority
from tests.gateway.harness import MODEL, ControlPlaneInMemory


def test_a_completion_body_becomes_a_generation_request():
    request = to_generation_request(
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "x",
            "top_k": 4,
            "ignore_eos": True,
            "priority": "batch",
            "stream": True,
        },
        chat=False,
        idempotency_key="k1",
    )
    assert request == GenerationRequest(
        model="m",
        prompt="hi",
        max_tokens=7,
        temperature=0.0,
        top_p=0.5,
        seed=3,
        stop=["x"],
        top_k=4,
        ignore_eos=True,
        priority=Priority.BATCH,
        idempotency_key="k1",
    )


def test_unset_options_stay_unset():
    request = to_generation_request({"model": "m", "prompt": "hi"}, chat=False, idempotency_key="")
    assert request == GenerationRequest(model="m", prompt="hi")
    assert request.max_tokens is request.temperature is request.top_p is request.seed is None


def test_token_id_prompts_and_batches_of_one():
    assert to_generation_request({"model": "m", "prompt": [1, 2]}, False, "").prompt_token_ids == [1, 2]
    assert to_generation_request({"model": "m", "prompt": [[4, 5]]}, False, "").prompt_token_ids == [4, 5]
    assert to_generation_request({"model": "m", "prompt": ["one"]}, False, "").prompt == "one"


def test_chat_messages_with_text_parts_and_max_completion_tokens():
    request = to_generation_request(
        {
            "model": "m",
            "max_completion_tokens": 5,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        },
        chat=True,
        idempotency_key="",
    )
    assert request.chat == [ChatMessage("developer", "be brief"), ChatMessage("user", "ab")]
    assert request.max_tokens == 5 and request.prompt is None and request.prompt_token_ids is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {
                "prompt": "hi",
                "max_tokens": 3,
                "temperature": 0.7,
                "top_p": 0.9,
                "seed": 2**64 - 1,
                "stop": ["a", "b"],
                "top_k": 40,
                "ignore_eos": True,
                "priority": "batch",
            },
            inference_pb2.GenerateRequest(
                prompt="hi",
                max_tokens=3,
                temperature=0.7,
                top_p=0.9,
                seed=2**64 - 1,
                stop=["a", "b"],
                top_k=40,
                ignore_eos=True,
                priority=inference_pb2.PRIORITY_BATCH,
            ),
        ),
        ({"prompt": [7, 8]}, inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=[7, 8]))),
        ({"prompt": "", "temperature": 1e300}, inference_pb2.GenerateRequest(prompt="", temperature=1e300)),
    ],
)
def test_both_fronts_map_one_request_to_the_same_generation_request(body, message):
    """Float parameters too: HTTP's are taken at the float32 precision the gRPC contract carries, so one
    request means the same, and has the same idempotency fingerprint, over either front."""
    message.model = "m"
    over_http = to_generation_request({"model": "m", **body}, chat=False, idempotency_key="")
    over_grpc = generation_request(message)
    assert over_http == over_grpc
    assert fingerprint(over_http) == fingerprint(over_grpc)


def test_grpc_chat_and_unset_fields_map_as_unset():
    message = inference_pb2.GenerateRequest(
        model="m",
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi")]),
        request_id="label-1",
        idempotency_key="k",
        priority=7,
    )
    assert generation_request(message) == GenerationRequest(
        model="m",
        chat=[ChatMessage("user", "hi")],
        client_request_id="label-1",
        idempotency_key="k",
        priority=7,
    )
    assert generation_request(inference_pb2.GenerateRequest(model="m")) == GenerationRequest(model="m")


def test_the_fingerprint_ignores_only_the_fields_that_name_the_request():
    base = GenerationRequest(model="m", prompt="hi")
    assert fingerprint(base) == fingerprint(
        GenerationRequest(model="m", prompt="hi", client_request_id="x", idempotency_key="k")
    )
    assert fingerprint(base) != fingerprint(GenerationRequest(model="m", prompt="hi", max_tokens=16))
    assert fingerprint(base) != fingerprint(GenerationRequest(model="m", prompt_token_ids=[1]))


@pytest.mark.parametrize(
    ("body", "chat", "message", "param"),
    [
        ({"prompt": "x"}, False, "model is required", "model"),
        ({"model": "m", "prompt": ["a", "b"]}, False, "one prompt per request", "prompt"),
        ({"model": "m", "prompt": [1, -2]}, False, "non-negative", "prompt"),
        ({"model": "m", "prompt": {"x": 1}}, False, "prompt is required", "prompt"),
        ({"model": "m", "prompt": "x", "n": 17}, False, "n must be an integer from 1 to 16", "n"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, False, "max_tokens must be an integer", "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, False, "temperature must be a number", "temperature"),
        ({"model": "m", "prompt": "x", "stop": [1]}, False, "stop must be a string", "stop"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, False, "logprobs must be an integer from 0 to 5", "logprobs"),
        ({"model": "m", "prompt": "x", "priority": "urgent"}, False, "priority must be one of", "priority"),
        ({"model": "m", "messages": []}, True, "messages must be a non-empty list", "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, True, "messages[0].role", "messages"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            True,
            "only text parts",
            "messages",
        ),
    ],
)
def test_bad_bodies_are_refused_naming_the_parameter(body, chat, message, param):
    with pytest.raises(HttpError) as raised:
        to_generation_request(body, chat, "")
    assert message in raised.value.message
    assert raised.value.param == param


async def test_a_developer_message_is_a_system_message_over_either_front():
    registry = Registry(ControlPlaneInMemory())
    await registry.refresh()

    def messages(role: str) -> list[dict]:
        return [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]

    def over_http(role: str) -> GenerationRequest:
        return to_generation_request({"model": MODEL, "messages": messages(role)}, chat=True, idempotency_key="")

    grpc_chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in messages("developer")])
    over_grpc = generation_request(inference_pb2.GenerateRequest(model=MODEL, chat=grpc_chat))
    assert over_grpc == over_http("developer")

    async def prompt(request: GenerationRequest) -> list[int]:
        return (await plan_generation(request, registry, "org_1")).prompt_token_ids

    system = await prompt(over_http("system"))
    assert await prompt(over_grpc) == await prompt(over_http("developer")) == system
    assert system != await prompt(over_http("user"))
