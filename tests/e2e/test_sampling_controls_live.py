"""logprobs, penalties and logit_bias on the live platform (real worker and gateway processes), split and
colocated, through the official `openai` client: tokens and logprobs equal a loop over `transformers`'
logits with the same bias and penalties."""

import openai
import pytest

from gateway.planning.tokenization import encode_chat
from tests.e2e.test_generation import random_prompts
from tests.workers.test_sampling_controls import LOGPROB_TOLERANCE, controlled_reference, controls

MODEL = "diptych-tiny"
BIAS = {"23": 4.0, "61": -100.0}


def params(count: int, top: int):
    bias = tuple(sorted((int(token), value) for token, value in BIAS.items()))
    return controls(
        count, presence_penalty=0.4, frequency_penalty=1.5, logit_bias=bias, logprobs=True, top_logprobs=top
    )


@pytest.fixture(params=["split", "colocated"])
def client(live, request):
    with openai.OpenAI(api_key=live.api_key, base_url=live.http_urls[request.param], max_retries=0) as client:
        yield client


def test_chat_logprobs_and_penalties_equal_the_reference_whole_and_streamed(client, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "name the colours of the evening"}]
    expected, expected_logprobs = controlled_reference(model, encode_chat(tokenizer, messages), 10, params(10, 3))
    options = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "presence_penalty": 0.4,
        "frequency_penalty": 1.5,
        "logit_bias": BIAS,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**options)
    content = whole.choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(**options, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    for entries in (content, streamed):
        assert [entry.token for entry in entries] == [tokenizer.decode([t]) for t in expected]
        for entry, (logprob, best) in zip(entries, expected_logprobs, strict=True):
            assert entry.logprob == pytest.approx(logprob, abs=LOGPROB_TOLERANCE)
            assert [alt.token for alt in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in best]


def test_completion_logprobs_with_a_bias_that_forces_a_token(client, reference):
    model, tokenizer = reference
    prompt = random_prompts(seed=33)[2]
    forced = controls(6, logit_bias=((99, 100.0),), logprobs=True, top_logprobs=1)
    expected, expected_logprobs = controlled_reference(model, prompt, 6, forced)
    assert expected == [99] * 6
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias={"99": 100}, logprobs=1
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([99])] * 6
    for got, (wanted, _) in zip(logprobs.token_logprobs, expected_logprobs, strict=True):
        assert got == pytest.approx(wanted, abs=LOGPROB_TOLERANCE)


def test_bad_sampling_controls_are_refused_naming_the_parameter(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], logit_bias={"100000": 5}, max_tokens=2
        )
    assert raised.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="hi", presence_penalty=2.5, max_tokens=2)
    assert raised.value.body["param"] == "presence_penalty"
