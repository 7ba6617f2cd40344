from __future__ import annotations

import dataclasses
import uuid
from typing import get_args, get_type_hints

import pytest

import diptych
from diptych._convert import (
    chat_input,
    chunk_from_proto,
    completion_from_chunks,
    generate_request,
    model_from_proto,
    new_idempotency_key,
    prompt_input,
)
from diptych.types import ChatMessageParam, PhaseUsage, Usage
from diptych_proto.v1 import inference_pb2 as pb


def test_text_prompt_request_leaves_unset_options_unset():
    request = generate_request(model="m", input_field=prompt_input(""), idempotency_key="key-1")
    assert request.WhichOneof("input") == "prompt" and request.prompt == ""
    assert (request.model, request.idempotency_key, request.request_id, list(request.stop)) == ("m", "key-1", "", [])
    assert (request.priority, request.ignore_eos) == (pb.PRIORITY_INTERACTIVE, False)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not request.HasField(name)


def test_token_prompt_and_every_option():
    request = generate_request(
        model="m",
        input_field=prompt_input([1, 2, 3]),
        idempotency_key="key-2",
        priority="batch",
        ignore_eos=True,
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
    assert (request.priority, request.ignore_eos) == (pb.PRIORITY_BATCH, True)


def test_single_stop_string():
    request = generate_request(model="m", input_field=prompt_input("x"), idempotency_key="k", stop="###")
    assert list(request.stop) == ["###"]


def test_chat_request():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = generate_request(model="m", input_field=chat_input(messages), idempotency_key="k")
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_a_developer_message_is_one_of_the_sdk_s_roles_and_goes_as_it_is():
    """The gateway reads it as a system message (tests/gateway/test_http_translation.py)."""
    assert "developer" in get_args(get_type_hints(ChatMessageParam)["role"])
    messages: list[ChatMessageParam] = [{"role": "developer", "content": "Be brief."}]
    request = generate_request(model="m", input_field=chat_input(messages), idempotency_key="k")
    assert [(m.role, m.content) for m in request.chat.messages] == [("developer", "Be brief.")]


def test_idempotency_keys_are_unique_uuids():
    keys = {new_idempotency_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(str(uuid.UUID(key)) == key for key in keys)


def test_intermediate_chunk():
    chunk = chunk_from_proto(pb.GenerateResponse(request_id="req_s", text="Hel", token_ids=[9, 10]))
    assert chunk == diptych.CompletionChunk(id="req_s", text="Hel", token_ids=[9, 10])
    assert chunk.finish_reason is None and chunk.usage is None


def test_a_stream_whose_last_chunk_has_no_usage_is_a_validation_error():
    # With n > 1 a choice's last chunk has a finish reason and no usage; the stream's last one must have both.
    chunk = chunk_from_proto(pb.GenerateResponse(request_id="req_u", finish_reason=pb.FINISH_REASON_STOP))
    with pytest.raises(diptych.APIResponseValidationError, match="finish_reason and usage") as raised:
        completion_from_chunks([chunk], model="m")
    assert raised.value.request_id == "req_u"


def test_usage_without_a_finish_reason_is_a_validation_error():
    with pytest.raises(diptych.APIResponseValidationError, match="no finish_reason"):
        chunk_from_proto(pb.GenerateResponse(request_id="req_v", usage=pb.Usage(prompt_tokens=1)))


def test_chunks_of_n_choices_make_a_completion_with_every_choice():
    usage = pb.Usage(prompt_tokens=3, completion_tokens=3)
    messages = [
        pb.GenerateResponse(request_id="r", text="a", token_ids=[1], index=0),
        pb.GenerateResponse(request_id="r", text="x", token_ids=[7], index=1),
        pb.GenerateResponse(request_id="r", text="b", token_ids=[2], index=0, finish_reason=pb.FINISH_REASON_LENGTH),
        pb.GenerateResponse(
            request_id="r", text="", token_ids=[0], index=1, finish_reason=pb.FINISH_REASON_STOP, usage=usage
        ),
    ]
    completion = completion_from_chunks([chunk_from_proto(m) for m in messages], model="m")
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in completion.choices] == [
        (0, "ab", [1, 2], "length"),
        (1, "x", [7, 0], "stop"),
    ]
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("ab", [1, 2], "length")
    assert completion.usage.completion_tokens == 3


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
    chunk = chunk_from_proto(message)
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
        chunk_from_proto(pb.GenerateResponse(finish_reason=9))


def test_completion_from_chunks():
    usage = Usage(prompt_tokens=2, completion_tokens=3, cached_tokens=0, total_tokens=5)
    chunks = [
        diptych.CompletionChunk(id="req_a", text="Hel", token_ids=[1, 2]),
        diptych.CompletionChunk(id="req_a", text="", token_ids=[]),
        diptych.CompletionChunk(id="req_a", text="lo", token_ids=[3], finish_reason="stop", usage=usage),
    ]
    completion = completion_from_chunks(chunks, model="m")
    assert completion == diptych.Completion(
        id="req_a",
        model="m",
        text="Hello",
        token_ids=[1, 2, 3],
        finish_reason="stop",
        usage=usage,
        choices=[diptych.types.Choice(index=0, text="Hello", token_ids=[1, 2, 3], finish_reason="stop")],
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        completion.text = "changed"


@pytest.mark.parametrize(
    ("chunks", "request_id"), [([], None), ([diptych.CompletionChunk(id="req_v", text="x", token_ids=[1])], "req_v")]
)
def test_completion_needs_a_final_chunk(chunks, request_id):
    with pytest.raises(diptych.APIResponseValidationError) as raised:
        completion_from_chunks(chunks, model="m")
    assert raised.value.request_id == request_id


def test_model_from_proto():
    model = model_from_proto(pb.Model(id="qwen", context_length=32768, has_chat_template=True))
    assert model == diptych.Model(id="qwen", context_length=32768, has_chat_template=True)
