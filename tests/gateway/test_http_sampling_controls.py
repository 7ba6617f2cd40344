"""presence_penalty, frequency_penalty, logit_bias, logprobs and top_logprobs at the gateway's doors: OpenAI's
bodies and the gRPC request map into the same GenerationRequest and plan; every bad value gets a 400 /
INVALID_ARGUMENT naming the parameter and runs nothing; the bounds themselves pass. (That they are
honoured, against `transformers`, is tests/workers/test_gateway_sampling_controls.py.)"""

import dataclasses
import json

import grpc
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.accounts.idempotency import fingerprint
from gateway.core.logprobs import CompletionLogprobs, chat_logprobs, token_bytes
from gateway.grpc_api.service import generation_request
from gateway.openai_api.requests import to_generation_request
from gateway.planning.tokenization import tokenizer_for
from gateway.types import GenerationRequest, TokenLogprob, TopLogprob
from tests.gateway.harness import API_KEY, MODEL, assert_openai_error_shape, in_process_gateway, post_json

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


def test_openai_bodies_and_the_grpc_request_map_to_the_same_request():
    chat = to_generation_request(
        {
            "model": "m",
            "messages": MESSAGES,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "logit_bias": {"12": -100, "7": 2.5},
            "logprobs": True,
            "top_logprobs": 4,
        },
        chat=True,
        idempotency_key="",
    )
    assert (chat.presence_penalty, chat.frequency_penalty) == (0.5, -1.0)
    assert chat.logit_bias == {12: -100.0, 7: 2.5}
    assert (chat.logprobs, chat.top_logprobs) == (True, 4)
    completion = to_generation_request({"model": "m", "prompt": "hi", "logprobs": 3}, chat=False, idempotency_key="")
    assert (completion.logprobs, completion.top_logprobs) == (True, 3)
    chosen_only = to_generation_request({"model": "m", "prompt": "hi", "logprobs": 0}, chat=False, idempotency_key="")
    assert (chosen_only.logprobs, chosen_only.top_logprobs) == (True, 0)
    unset = to_generation_request({"model": "m", "prompt": "hi"}, chat=False, idempotency_key="")
    assert (unset.logprobs, unset.top_logprobs, unset.logit_bias, unset.presence_penalty) == (False, None, None, None)
    over_grpc = generation_request(
        inference_pb2.GenerateRequest(
            model="m",
            prompt="hi",
            presence_penalty=0.5,
            frequency_penalty=-1,
            logit_bias={12: -100, 7: 2.5},
            logprobs=True,
            top_logprobs=4,
        )
    )
    over_http = to_generation_request(
        {
            "model": "m",
            "prompt": "hi",
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "logit_bias": {"12": -100, "7": 2.5},
        },
        chat=False,
        idempotency_key="",
    )
    assert over_grpc == GenerationRequest(
        model="m",
        prompt="hi",
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias={12: -100.0, 7: 2.5},
        logprobs=True,
        top_logprobs=4,
    )
    # the same request over either API is the same request to an idempotency key
    assert fingerprint(over_http) == fingerprint(dataclasses.replace(over_grpc, logprobs=False, top_logprobs=None))
    assert generation_request(inference_pb2.GenerateRequest(model="m", prompt="hi")).logit_bias is None


BAD = [  # (URL, extra body, param, part of the message)
    (CHAT, {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs set to true"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be an integer from 0 to 20"),
    (CHAT, {"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "top_logprobs must be an integer"),
    (CHAT, {"logprobs": 3}, "logprobs", "logprobs must be true or false"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs", "logprobs must be an integer from 0 to 5"),
    (COMPLETIONS, {"logprobs": True}, "logprobs", "logprobs must be an integer from 0 to 5"),
    (COMPLETIONS, {"logprobs": 2, "top_logprobs": 2}, "top_logprobs", "not a parameter of /v1/completions"),
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be from -2 to 2, got 2.5"),
    (COMPLETIONS, {"frequency_penalty": -2.01}, "frequency_penalty", "frequency_penalty must be from -2 to 2"),
    (COMPLETIONS, {"frequency_penalty": 1e300}, "frequency_penalty", "frequency_penalty must be from -2 to 2, got inf"),
    (CHAT, {"presence_penalty": "high"}, "presence_penalty", "presence_penalty must be a number"),
    (CHAT, {"logit_bias": [1, 2]}, "logit_bias", "logit_bias must be an object"),
    (CHAT, {"logit_bias": {"dog": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    (CHAT, {"logit_bias": {"-3": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    (COMPLETIONS, {"logit_bias": {"5": "up"}}, "logit_bias", "logit_bias values must be numbers"),
    (COMPLETIONS, {"logit_bias": {"5": True}}, "logit_bias", "logit_bias values must be numbers"),
    (CHAT, {"logit_bias": {"5": 100.5}}, "logit_bias", "logit_bias for token 5 must be from -100 to 100"),
    (CHAT, {"logit_bias": {"512": 1}}, "logit_bias", "logit_bias names token 512, outside the vocabulary of size 512"),
    (
        CHAT,
        {"logit_bias": {str(i): 1 for i in range(301)}},
        "logit_bias",
        "logit_bias holds 301 tokens; send at most 300",
    ),
]


@pytest.mark.parametrize(("url", "extra", "param", "message"), BAD)
async def test_bad_values_get_a_400_naming_the_parameter_and_run_nothing(gateway, url, extra, param, message):
    body = {"model": MODEL, **({"messages": MESSAGES} if url == CHAT else {"prompt": "hi"}), **extra}
    status, payload = await post_json(gateway, url, json.dumps(body).encode())
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert message in payload["error"]["message"]
    assert payload["error"]["param"] == param
    assert gateway.path.runs == 0


@pytest.mark.parametrize(
    ("url", "extra"),
    [
        (CHAT, {"presence_penalty": -2, "frequency_penalty": 2, "logprobs": True, "top_logprobs": 20}),
        (CHAT, {"logit_bias": {"0": -100, "511": 100}, "logprobs": False}),
        (CHAT, {"logit_bias": {str(i): 1 for i in range(300)}}),
        (COMPLETIONS, {"logprobs": 5, "presence_penalty": 0, "logit_bias": {}}),
        (COMPLETIONS, {"logprobs": None, "frequency_penalty": None}),
    ],
)
async def test_the_bounds_themselves_pass_the_door(gateway, url, extra):
    body = {"model": MODEL, **({"messages": MESSAGES} if url == CHAT else {"prompt": "hi"}), **extra}
    status, payload = await post_json(gateway, url, json.dumps(body).encode())
    assert status == 503, payload  # past the door; the harness has no workers
    assert gateway.path.runs == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 3.0}, "presence_penalty must be from -2 to 2, got 3"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be from -2 to 2, got nan"),
        ({"logit_bias": {600: 1.0}}, "logit_bias names token 600, outside the vocabulary"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias for token 3 must be from -100 to 100, got inf"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs set to true"),
        ({"logprobs": True, "top_logprobs": 25}, "top_logprobs must be from 0 to 20, got 25"),
    ],
)
async def test_bad_values_over_grpc_are_invalid_argument(gateway, fields, message):
    call = inference_pb2_grpc.InferenceStub(gateway.channel).Generate(
        inference_pb2.GenerateRequest(model=MODEL, prompt="hi", **fields),
        metadata=(("authorization", f"Bearer {API_KEY}"),),
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()
    assert gateway.path.runs == 0


def test_openai_shapes_of_logprobs():
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    hello, partial = tokenizer.encode("hello")[0], 250  # a token of a few characters, and a lone byte's
    entries = [
        TokenLogprob(hello, tokenizer.decode([hello]), -0.5, (TopLogprob(hello, tokenizer.decode([hello]), -0.5),)),
        TokenLogprob(partial, tokenizer.decode([partial]), -2.0, (TopLogprob(9, tokenizer.decode([9]), -1.0),)),
    ]
    chat = chat_logprobs(tokenizer, entries)["content"]
    assert [entry["token"] for entry in chat] == [tokenizer.decode([hello]), "\ufffd"]
    assert chat[0]["bytes"] == list(tokenizer.decode([hello]).encode())
    assert len(chat[1]["bytes"]) == 1 and chat[1]["bytes"] != list("\ufffd".encode())  # the token's own byte
    assert chat[1]["top_logprobs"] == [
        {"token": tokenizer.decode([9]), "logprob": -1.0, "bytes": token_bytes(tokenizer, 9, tokenizer.decode([9]))}
    ]
    shapes = CompletionLogprobs()
    first, second = shapes.shape(entries[:1]), shapes.shape(entries[1:])
    assert first["text_offset"] == [0] and second["text_offset"] == [len(entries[0].token)]
    assert second["top_logprobs"] == [{tokenizer.decode([9]): -1.0, "\ufffd": -2.0}]  # the sampled token too
    assert first["token_logprobs"] == [-0.5]
