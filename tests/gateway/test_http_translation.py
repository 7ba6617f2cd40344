"""The OpenAI-compatible request bodies, translated into the public GenerateRequest, and refusals."""

import pytest

from diptych._proto.v1 import inference_pb2
from gateway.http_api import HttpError, _to_generate_request


def test_a_completion_body_becomes_a_generate_request():
    request = _to_generate_request(
        {"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
         "stop": "x", "top_k": 4, "ignore_eos": True, "priority": "batch", "stream": True},
        chat=False, idempotency_key="k1",
    )
    assert request.prompt == "hi" and request.max_tokens == 7 and request.temperature == 0
    assert request.HasField("temperature") and request.top_p == 0.5 and request.seed == 3
    assert list(request.stop) == ["x"] and request.top_k == 4 and request.ignore_eos
    assert request.priority == inference_pb2.PRIORITY_BATCH and request.idempotency_key == "k1"


def test_token_id_prompts_and_batches_of_one():
    assert list(_to_generate_request({"model": "m", "prompt": [1, 2]}, False, "").prompt_token_ids.ids) == [1, 2]
    assert list(_to_generate_request({"model": "m", "prompt": [[4, 5]]}, False, "").prompt_token_ids.ids) == [4, 5]
    assert _to_generate_request({"model": "m", "prompt": ["one"]}, False, "").prompt == "one"


def test_chat_messages_with_text_parts_and_max_completion_tokens():
    request = _to_generate_request(
        {"model": "m", "max_completion_tokens": 5, "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]},
        chat=True, idempotency_key="",
    )
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be brief"), ("user", "ab")]
    assert request.max_tokens == 5


@pytest.mark.parametrize(("body", "chat", "message", "param"), [
    ({"prompt": "x"}, False, "model is required", "model"),
    ({"model": "m", "prompt": ["a", "b"]}, False, "one prompt per request", "prompt"),
    ({"model": "m", "prompt": [1, -2]}, False, "non-negative", "prompt"),
    ({"model": "m", "prompt": {"x": 1}}, False, "prompt is required", "prompt"),
    ({"model": "m", "prompt": "x", "n": 2}, False, "n and best_of must be 1", "n"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, False, "max_tokens must be an integer", "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, False, "temperature must be a number", "temperature"),
    ({"model": "m", "prompt": "x", "stop": [1]}, False, "stop must be a string", "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 2}, False, "logprobs are not supported", "logprobs"),
    ({"model": "m", "prompt": "x", "priority": "urgent"}, False, "priority must be one of", "priority"),
    ({"model": "m", "messages": []}, True, "messages must be a non-empty list", "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, True, "messages[0].role", "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "only text parts", "messages"),
])
def test_bad_bodies_are_refused_naming_the_parameter(body, chat, message, param):
    with pytest.raises(HttpError) as raised:
        _to_generate_request(body, chat, "")
    assert message in raised.value.message
    assert raised.value.param == param
