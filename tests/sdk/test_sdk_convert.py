from __future__ import annotations

import dataclasses

import pytest

import diptych
from diptych._convert import (
    chat_input,
    chunk_from_proto,
    completion_from_chunks,
    generate_request,
    model_from_proto,
    new_request_id,
    prompt_input,
)
from diptych._proto.v1 import inference_pb2 as pb
from diptych.types import PhaseUsage, Usage


def test_text_prompt_request_leaves_unset_options_unset():
    request = generate_request(model="m", input_field=prompt_input(""), request_id="req_1")
    assert request.WhichOneof("input") == "prompt" and request.prompt == ""
    assert (request.model, request.request_id, list(request.stop)) == ("m", "req_1", [])
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not request.HasField(name)


def test_token_prompt_and_every_option():
    request = generate_request(
        model="m",
        input_field=prompt_input([1, 2, 3]),
        request_id="req_2",
        max_tokens=32,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        seed=2**40,
        stop=["\n", "END"],
    )
    assert request.WhichOneof("input") == "prompt_token_ids"
    assert list(request.prompt_token_ids.ids) == [1, 2, 3]
    assert request.HasField("temperature") and request.temperature == 0.0  # 0 means greedy, so it must be sent
    assert (request.max_tokens, request.top_p, request.top_k, request.seed) == (32, 0.5, 40, 2**40)
    assert list(request.stop) == ["\n", "END"]


def test_single_stop_string():
    request = generate_request(model="m", input_field=prompt_input("x"), request_id="r", stop="###")
    assert list(request.stop) == ["###"]


def test_chat_request():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = generate_request(model="m", input_field=chat_input(messages), request_id="r")
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_request_ids_are_unique_and_prefixed():
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(request_id.startswith("req_") and len(request_id) == 36 for request_id in ids)


def test_intermediate_chunk():
    chunk = chunk_from_proto(pb.GenerateResponse(request_id="req_s", text="Hel", token_ids=[9, 10]), request_id="x")
    assert chunk == diptych.CompletionChunk(id="req_s", text="Hel", token_ids=[9, 10])
    assert chunk.finish_reason is None and chunk.usage is None


def test_chunk_without_request_id_uses_the_clients():
    assert chunk_from_proto(pb.GenerateResponse(text="a"), request_id="req_c").id == "req_c"


def test_final_chunk_with_usage():
    message = pb.GenerateResponse(
        request_id="req_f",
        text="lo",
        token_ids=[11],
        finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(
            prompt_tokens=7,
            completion_tokens=3,
            cached_tokens=4,
            prefill=pb.PhaseUsage(tokens=7, cached_tokens=4, kv_bytes=2**33, compute_ms=15, worker_id="p0"),
        ),
    )
    chunk = chunk_from_proto(message, request_id="req_f")
    assert chunk.finish_reason == "length"
    assert chunk.usage == Usage(
        prompt_tokens=7,
        completion_tokens=3,
        cached_tokens=4,
        total_tokens=10,
        prefill=PhaseUsage(tokens=7, cached_tokens=4, kv_bytes=2**33, compute_ms=15, worker_id="p0"),
        decode=None,
    )


def test_unknown_finish_reason_is_a_validation_error():
    with pytest.raises(diptych.APIResponseValidationError, match="finish_reason 9"):
        chunk_from_proto(pb.GenerateResponse(finish_reason=9), request_id="r")


def test_completion_from_chunks():
    usage = Usage(prompt_tokens=2, completion_tokens=3, cached_tokens=0, total_tokens=5)
    chunks = [
        diptych.CompletionChunk(id="req_a", text="Hel", token_ids=[1, 2]),
        diptych.CompletionChunk(id="req_a", text="", token_ids=[]),
        diptych.CompletionChunk(id="req_a", text="lo", token_ids=[3], finish_reason="stop", usage=usage),
    ]
    completion = completion_from_chunks(chunks, model="m", request_id="req_a")
    assert completion == diptych.Completion(
        id="req_a", model="m", text="Hello", token_ids=[1, 2, 3], finish_reason="stop", usage=usage
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        completion.text = "changed"


@pytest.mark.parametrize("chunks", [[], [diptych.CompletionChunk(id="r", text="x", token_ids=[1])]])
def test_completion_needs_a_final_chunk(chunks):
    with pytest.raises(diptych.APIResponseValidationError) as raised:
        completion_from_chunks(chunks, model="m", request_id="req_v")
    assert raised.value.request_id == "req_v"


def test_model_from_proto():
    model = model_from_proto(pb.Model(id="qwen", context_length=32768, has_chat_template=True))
    assert model == diptych.Model(id="qwen", context_length=32768, has_chat_template=True)
