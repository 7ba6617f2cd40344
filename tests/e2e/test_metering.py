"""Usage reaches the control plane's ledger: one event per request and phase, counted once."""

import time

import pytest

import diptych
from diptych_common.internal_api.messages import UsageEvent


def usage_events(live, request_id: str, expected: int, seconds: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + seconds
    with live.rest() as rest:
        while True:
            events = rest.get("/usage-events", params={"request_id": request_id}).json()["data"]
            if len(events) >= expected or time.monotonic() > deadline:
                return events
            time.sleep(0.1)


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_each_request_leaves_one_prefill_and_one_decode_event(live, mode):
    with diptych.Client(api_key=live.api_key, base_url=live.gateways[mode]) as client:
        completions = [
            client.completions.create(model="diptych-tiny", prompt=[9] * length, max_tokens=tokens, temperature=0)
            for length, tokens in ((3, 1), (30, 7), (90, 12))
        ]
    for completion in completions:
        events = {e["phase"]: e for e in usage_events(live, completion.id, expected=2)}
        assert set(events) == {"prefill", "decode"}
        assert events["prefill"]["tokens"] == completion.usage.prompt_tokens
        assert events["decode"]["tokens"] == completion.usage.completion_tokens
        assert events["prefill"]["worker_id"] == completion.usage.prefill.worker_id
        assert events["decode"]["worker_id"] == completion.usage.decode.worker_id
        assert events["prefill"]["model"] == "diptych-tiny"
    # Nothing arrives later: still exactly two per request once the gateway has sent everything it held.
    live.wait_until_usage_sent(mode)
    for completion in completions:
        assert len(usage_events(live, completion.id, expected=3, seconds=0)) == 2


def test_posting_the_same_usage_batch_twice_counts_it_once(live):
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client:
        completion = client.completions.create(
            model="diptych-tiny", prompt="count me once", max_tokens=3, temperature=0
        )
    stored = usage_events(live, completion.id, expected=2)
    organization_id = live.credentials.organization_id  # the ledger's events, as the gateway reports them
    batch = [UsageEvent.from_wire({**event, "organization_id": organization_id}).to_wire() for event in stored]
    with live.internal() as internal:
        first = internal.post("/usage-events", json={"events": batch})
        second = internal.post("/usage-events", json={"events": batch})
    assert first.json() == {"accepted": 0, "duplicates": 2}
    assert second.json() == {"accepted": 0, "duplicates": 2}
    assert len(usage_events(live, completion.id, expected=3, seconds=0)) == 2


def test_usage_of_a_cancelled_stream_counts_the_tokens_delivered(live):
    max_tokens = 1000  # with the prompt, all of diptych-tiny's context: the stream is left far from its end
    watch = live.watch_cancellation(max_tokens)
    with (
        diptych.Client(api_key=live.api_key, base_url=live.gateways["split"]) as client,
        client.completions.create(
            model="diptych-tiny", prompt=[11] * 20, max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True
        ) as stream,
    ):
        received = []
        for chunk in stream:
            received.append(chunk)
            if len(received) == 5:
                break
    watch.assert_freed(prompt_tokens=20)
    events = {e["phase"]: e for e in usage_events(live, received[0].id, expected=2)}
    assert events["prefill"]["tokens"] == 20
    assert 5 <= events["decode"]["tokens"] < max_tokens / 2
