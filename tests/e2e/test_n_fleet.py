"""n > 1 and prompt_cache_key in front of two prefill and two decode workers: every choice survives the
death of the decode worker serving it (each migrates, whole, and is billed once), and requests sharing a
prompt_cache_key go to the key's prefill worker even when another holds their prefix.

Its own platform (the fleet of test_gateway_fleet.py), since these tests kill processes.
"""

import asyncio
import signal

from diptych_proto.v1 import inference_pb2_grpc
from tests.e2e.test_gateway_fleet import (
    Completion,
    complete,
    fleet,  # noqa: F401  (the module's platform)
    ledger_events,
    long_prompt,
    request,
    serving_decode_worker,
)
from tests.e2e.test_generation import generate_reference


async def test_a_decode_worker_killed_mid_stream_leaves_every_choice_whole(fleet, reference):  # noqa: F811
    model, _ = reference
    prompt = long_prompt(18, 40)  # its greedy output runs all 300 tokens: far longer than the kill takes
    max_tokens = 300
    expected = generate_reference(model, prompt, max_tokens)
    migrations_before = fleet.metric("diptych_gateway_decode_migrations_total")
    received: dict[int, list[int]] = {0: [], 1: []}
    usage, killed, request_id = None, None, ""
    async with fleet.channel() as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request(prompt, max_tokens, n=2), metadata=fleet.auth, timeout=180
        )
        async for response in call:
            request_id = response.request_id
            received[response.index].extend(response.token_ids)
            if response.HasField("usage"):
                usage = response.usage
            if killed is None and min(len(tokens) for tokens in received.values()) >= 10:
                killed = serving_decode_worker(fleet)  # both choices decode there: one worker is busy
                killed_id = fleet.current_id(killed)
                fleet.stack.stop_process(killed, signal.SIGKILL)
    assert killed is not None
    assert received == {0: expected, 1: expected}  # no token repeated, none missing, in either choice
    assert usage.completion_tokens == 2 * len(expected) and usage.prompt_tokens == len(prompt)
    assert usage.decode.worker_id != killed_id
    assert fleet.metric("diptych_gateway_decode_migrations_total") == migrations_before + 2
    fleet.workers.pop(killed)
    # The prompt billed once, by choice 0's first prefill; every choice's tokens by decode.
    events = await ledger_events(fleet, request_id, expected=2)
    assert {e["phase"]: e["tokens"] for e in events} == {"prefill": len(prompt), "decode": len(expected)}
    events = await ledger_events(fleet, f"{request_id}-c1", expected=1)
    assert {e["phase"]: e["tokens"] for e in events} == {"decode": len(expected)}


async def test_a_prompt_cache_key_keeps_its_prefill_worker_over_the_prefix_holder(fleet, reference):  # noqa: F811
    model, _ = reference
    keyed = long_prompt(400, 200)
    others = [long_prompt(401 + i, 200) for i in range(7)]
    # Concurrent requests spread over both prefill workers; the keyed one lands on one of them.
    results = await asyncio.gather(
        keyed_completion(fleet, keyed, "session-a"), *(complete(fleet, prompt, 2) for prompt in others)
    )
    key_worker = results[0].usage.prefill.worker_id
    elsewhere = [p for p, r in zip(others, results[1:], strict=True) if r.usage.prefill.worker_id != key_worker]
    assert elsewhere, "no request went to the other prefill worker"
    held = elsewhere[0]
    # Without the key, a prompt extending `held` goes to the worker holding it ...
    plain = await complete(fleet, [*held, 7, 8, 9], 2)
    assert plain.usage.prefill.worker_id != key_worker and plain.usage.cached_tokens > 0
    # ... and so does one with another key, which is another session: ordinary routing ...
    other = await keyed_completion(fleet, [*held, 7, 8, 11], "session-b")
    assert other.usage.prefill.worker_id == plain.usage.prefill.worker_id
    # ... but with the first key, to the key's worker, which computes it whole. (Asked last: afterwards
    # both workers hold the prefix, and ordinary routing may pick either.)
    kept = await keyed_completion(fleet, [*held, 7, 8, 10], "session-a")
    assert kept.usage.prefill.worker_id == key_worker and kept.usage.cached_tokens == 0
    assert kept.tokens == generate_reference(model, [*held, 7, 8, 10], 2)


async def keyed_completion(fleet, prompt: list[int], key: str) -> Completion:  # noqa: F811
    async with fleet.channel() as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tokens, usage, request_id = [], None, ""
        message = request(prompt, 2, prompt_cache_key=key)
        async for response in stub.Generate(message, metadata=fleet.auth, timeout=60):
            tokens.extend(response.token_ids)
            request_id = response.request_id
            usage = response.usage if response.HasField("usage") else usage
    return Completion(tokens, usage, request_id)
