"""The SDK's sampling controls: penalties, logit_bias and logprobs into the request, and logprobs out of the
responses, per chunk and per choice. (Live against the gateway: tests/workers/test_gateway_sampling_controls.py.)"""

from __future__ import annotations

import pytest

from diptych._convert import chunk_from_proto, completion_from_chunks, generate_request, prompt_input
from diptych.types import TokenLogprob, TopLogprob
from diptych_proto.v1 import inference_pb2 as pb


def test_penalties_bias_and_logprobs_go_into_the_request():
    request = generate_request(
        model="m",
        input_field=prompt_input("x"),
        idempotency_key="k",
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        logit_bias={"12": -100, 7: 2.5},
        logprobs=True,
        top_logprobs=3,
    )
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, -1.0)
    assert dict(request.logit_bias) == {12: -100.0, 7: 2.5}
    assert request.logprobs and request.top_logprobs == 3


def test_unset_controls_stay_unset():
    request = generate_request(model="m", input_field=prompt_input("x"), idempotency_key="k")
    for name in ("presence_penalty", "frequency_penalty", "top_logprobs"):
        assert not request.HasField(name)
    assert not request.logprobs and not request.logit_bias


@pytest.mark.parametrize("key", ["dog", "-1", None])
def test_a_logit_bias_key_that_is_no_token_id_is_refused(key):
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        generate_request(model="m", input_field=prompt_input("x"), idempotency_key="k", logit_bias={key: 1.0})


def _response(token_id: int, logprob: float, finish: int = pb.FINISH_REASON_UNSPECIFIED) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id="r",
        text=f"t{token_id}",
        token_ids=[token_id],
        finish_reason=finish,
        logprobs=[
            pb.TokenLogprob(
                token_id=token_id,
                token=f"t{token_id}",
                logprob=logprob,
                top_logprobs=[pb.TopLogprob(token_id=9, token="t9", logprob=-0.25)],
            )
        ],
    )
    if finish:
        response.usage.CopyFrom(pb.Usage(prompt_tokens=2, completion_tokens=2))
    return response


def test_logprobs_come_out_per_chunk_and_joined_per_choice():
    chunks = [chunk_from_proto(_response(4, -0.5)), chunk_from_proto(_response(5, -1.5, pb.FINISH_REASON_LENGTH))]
    assert chunks[0].logprobs == [TokenLogprob("t4", 4, -0.5, [TopLogprob("t9", 9, -0.25)])]
    completion = completion_from_chunks(chunks, model="m")
    assert [entry.token_id for entry in completion.logprobs] == [4, 5]
    assert completion.choices[0].logprobs == completion.logprobs
    plain = chunk_from_proto(pb.GenerateResponse(request_id="r", text="x", token_ids=[1]))
    assert plain.logprobs is None
