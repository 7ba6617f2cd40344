"""Every execution is billed once, to its own organization, for what it delivered: client-chosen ids and
idempotency keys never make tokens free, and a gateway killed mid-stream loses no usage."""

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from diptych_server.stack import free_port
from tests.e2e.conftest import new_organization
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"
LONG_OUTPUT = 1000  # with a short prompt, all of diptych-tiny's context: a cancelled stream is far from its end


def ledger(live, api_key: str, **filters) -> list[dict]:
    with live.rest(api_key) as rest:
        return rest.get("/usage-events", params={"limit": 200, **filters}).json()["data"]


def billed_output(live, api_key: str, execution_id: str, timeout: float = 15.0) -> int:
    """The decode tokens the ledger holds for one execution, once both its events arrived."""
    events = wait_for(lambda: (e := ledger(live, api_key, request_id=execution_id)) and len(e) == 2 and e, timeout)
    assert events, f"no usage for {execution_id}"
    return next(e["tokens"] for e in events if e["phase"] == "decode")


async def generate(address: str, api_key: str, **fields) -> tuple[str, int]:
    """The execution id and the number of tokens one streamed request delivered."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(model=MODEL, temperature=0, **fields)
        execution_id, tokens = "", 0
        async for response in stub.Generate(request, metadata=(("authorization", f"Bearer {api_key}"),), timeout=60):
            execution_id = response.request_id
            tokens += len(response.token_ids)
        return execution_id, tokens


def address(live, mode: str = "split") -> str:
    return live.gateways[mode].removeprefix("grpc://")


@asynccontextmanager
async def keyed_calls(live, key: str):
    """Starts Generate calls of requests carrying the idempotency key `key`, with the demo key."""
    async with grpc.aio.insecure_channel(address(live)) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        def call(**fields):
            request = inference_pb2.GenerateRequest(model=MODEL, temperature=0, idempotency_key=key, **fields)
            return stub.Generate(request, metadata=(("authorization", f"Bearer {live.api_key}"),), timeout=60)

        yield call


def test_requests_sharing_a_client_request_id_are_each_billed_in_full(live):
    async def twenty():
        return await asyncio.gather(
            *[
                generate(
                    address(live),
                    live.api_key,
                    prompt_token_ids=inference_pb2.TokenIds(ids=[5 + i, 7, 9]),
                    max_tokens=20,
                    ignore_eos=True,
                    request_id="same-id",
                )
                for i in range(20)
            ]
        )

    results = asyncio.run(twenty())
    executions = {execution_id for execution_id, _ in results}
    assert len(executions) == 20, "each execution gets its own server-issued id"
    assert all(tokens == 20 for _, tokens in results)
    billed = {execution_id: billed_output(live, live.api_key, execution_id) for execution_id in executions}
    assert sum(billed.values()) == 400
    labelled = ledger(live, live.api_key, client_request_id="same-id", phase="decode")
    assert {e["request_id"] for e in labelled} >= executions


def test_an_id_another_organization_used_first_neither_frees_nor_blocks_a_request(live, other_organization):
    shared = f"shared-{uuid.uuid4().hex[:8]}"

    async def both():
        first = await generate(
            address(live),
            other_organization["api_key"],
            prompt="theirs",
            max_tokens=6,
            ignore_eos=True,
            request_id=shared,
        )
        concurrent = await asyncio.gather(
            generate(address(live), live.api_key, prompt="mine", max_tokens=6, ignore_eos=True, request_id=shared),
            generate(
                address(live),
                other_organization["api_key"],
                prompt="theirs again",
                max_tokens=6,
                ignore_eos=True,
                request_id=shared,
            ),
        )
        return first, concurrent

    (other_first, ((mine, mine_tokens), (other_second, _))) = asyncio.run(both())
    assert mine_tokens == 6
    assert billed_output(live, live.api_key, mine) == 6
    assert billed_output(live, other_organization["api_key"], other_first[0]) == 6
    assert billed_output(live, other_organization["api_key"], other_second) == 6
    assert ledger(live, live.api_key, request_id=other_first[0]) == [], "never billed to the wrong organization"


def test_a_completed_idempotency_key_replays_the_stored_result_without_running_again(live):
    fields = dict(prompt="replay me", max_tokens=8, ignore_eos=True)

    async def twice():
        async with keyed_calls(live, f"idem-{uuid.uuid4().hex}") as call:
            first = [r async for r in call(**fields)]
            replay = call(**fields)
            second = [r async for r in replay]
            return first, second, await replay.initial_metadata()

    first, second, initial_metadata = asyncio.run(twice())
    assert ("idempotent-replayed", "true") in tuple(initial_metadata)
    assert len(second) == 1
    assert second[0].request_id == first[0].request_id
    assert second[0].text == "".join(r.text for r in first)
    assert list(second[0].token_ids) == [t for r in first for t in r.token_ids]
    assert second[0].usage == first[-1].usage
    assert billed_output(live, live.api_key, first[0].request_id) == 8
    live.wait_until_usage_sent("split")  # whatever the gateway still held has reached the ledger
    assert len(ledger(live, live.api_key, request_id=first[0].request_id)) == 2, "billed once, replayed free"


def test_an_idempotency_key_in_flight_or_used_for_another_request_is_refused(live):
    long = dict(prompt="long", max_tokens=LONG_OUTPUT, ignore_eos=True)
    watch = live.watch_cancellation(LONG_OUTPUT)

    async def scenario():
        async with keyed_calls(live, f"idem-{uuid.uuid4().hex}") as call:
            running = call(**long)
            await running.read()
            with pytest.raises(grpc.aio.AioRpcError) as conflict:
                await call(**long).read()
            with pytest.raises(grpc.aio.AioRpcError) as mismatch:
                await call(prompt="other", max_tokens=2).read()
            running.cancel()
            return conflict.value, mismatch.value

    conflict, mismatch = asyncio.run(scenario())
    watch.assert_freed()  # the cancelled first request leaves the workers too
    assert conflict.code() is grpc.StatusCode.ABORTED
    assert "still running" in conflict.details()
    assert mismatch.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "different parameters" in mismatch.details()


def test_a_cancelled_execution_frees_its_key_and_the_retry_is_billed_as_a_new_execution(live):
    fields = dict(prompt="cut", max_tokens=LONG_OUTPUT, ignore_eos=True)
    watch = live.watch_cancellation(LONG_OUTPUT)

    async def cancel_then_retry():
        async with keyed_calls(live, f"idem-{uuid.uuid4().hex}") as call:
            cut = call(**fields)
            first = await cut.read()
            cut.cancel()
            await asyncio.to_thread(watch.assert_freed)
            deadline = time.monotonic() + 5
            while True:  # the key is released just after the cancelled stream ends
                retry = call(**fields)
                try:
                    return first.request_id, [r async for r in retry]
                except grpc.aio.AioRpcError as error:
                    assert error.code() is grpc.StatusCode.ABORTED
                    assert time.monotonic() < deadline, "the key was never released"
                await asyncio.sleep(0.1)

    cancelled, retried = asyncio.run(cancel_then_retry())
    assert retried[0].request_id != cancelled
    assert sum(len(r.token_ids) for r in retried) == LONG_OUTPUT
    assert billed_output(live, live.api_key, retried[0].request_id) == LONG_OUTPUT
    assert 1 <= billed_output(live, live.api_key, cancelled) < LONG_OUTPUT / 2


def test_a_gateway_killed_mid_stream_bills_every_delivered_token_when_it_restarts(live):
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    name = f"gateway-killed-{port}"
    live.stack.start_gateway(name, port, metrics_port, "split", http_port=http_port)
    received: dict[str, int] = {}

    async def streams_until_killed():
        async def one(i: int):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                request = inference_pb2.GenerateRequest(
                    model=MODEL, prompt=f"stream {i}", max_tokens=1000, ignore_eos=True, temperature=0
                )
                call = stub.Generate(request, metadata=(("authorization", f"Bearer {live.api_key}"),), timeout=60)
                try:
                    async for response in call:
                        received[response.request_id] = received.get(response.request_id, 0) + 1
                except grpc.aio.AioRpcError as error:
                    assert error.code() is grpc.StatusCode.UNAVAILABLE, error  # the gateway died

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        deadline = time.monotonic() + 60
        while len(received) < 4 or min(received.values()) < 10:
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), "the streams did not start"
            await asyncio.sleep(0.05)
        live.stack.kill_process(name)
        await asyncio.gather(*tasks)

    asyncio.run(streams_until_killed())
    assert len(received) == 4
    live.stack.start_gateway(name, port, metrics_port, "split", http_port=http_port)  # same journal
    try:
        for execution_id, tokens in received.items():
            # Billed: what the gateway handed to the connection, of which the client may have missed the last.
            assert tokens <= billed_output(live, live.api_key, execution_id) < 1000
    finally:
        live.stack.stop_process(name)


def test_a_gateway_killed_before_a_whole_answer_went_out_bills_nothing_of_it(live, control_plane_shell):
    """A non-streaming answer is handed over in one piece: until it is, nothing of it was delivered, and
    a gateway killed while it runs bills none of it (a streamed answer beside it bills what it delivered)."""
    api_key = new_organization(control_plane_shell)["api_key"]
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    name = f"gateway-killed-whole-{port}"
    live.stack.start_gateway(name, port, metrics_port, "split", http_port=http_port)
    body = {"model": MODEL, "prompt": "whole", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

    async def whole_answers_until_killed() -> int:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as client:
            await _until_it_answers(client, live.api_key)  # the demo organization's: this one's ledger stays clean
            headers = {"Authorization": f"Bearer {api_key}"}
            waiting = [
                asyncio.create_task(client.post("/v1/completions", json=body, headers=headers)) for _ in range(2)
            ]
            deadline, produced_before = time.monotonic() + 60, _tokens_produced(metrics_port)
            while _tokens_produced(metrics_port) < produced_before + 40:  # both run, far from their ends
                ended = [t.result() for t in waiting if t.done() and not t.exception()]
                assert time.monotonic() < deadline and not ended, f"the requests did not run: {ended}"
                await asyncio.sleep(0.05)
            live.stack.kill_process(name)
            failed = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(outcome, httpx.TransportError) for outcome in failed), failed
        streamed = [0]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # a gateway on the same journal
            live.stack.start_gateway(name, port, metrics_port, "split", http_port=http_port)
            request = inference_pb2.GenerateRequest(model=MODEL, prompt="streamed", max_tokens=5, temperature=0)
            stub = inference_pb2_grpc.InferenceStub(channel)
            async for response in stub.Generate(request, metadata=(("authorization", f"Bearer {api_key}"),)):
                streamed[0] += len(response.token_ids)
        return streamed[0]

    try:
        streamed = asyncio.run(whole_answers_until_killed())
        decode_billed = lambda: [e["tokens"] for e in ledger(live, api_key, phase="decode")]  # noqa: E731
        assert wait_for(lambda: streamed in decode_billed(), 30), "the streamed request was not billed"
        time.sleep(1)  # the gateway's outbox flushes every 100 ms: anything recovered would be there by now
        billed = ledger(live, api_key)
        assert len(billed) == 2, f"an answer that never went out was billed: {billed}"
    finally:
        live.stack.stop_process(name)


async def _until_it_answers(client: httpx.AsyncClient, api_key: str) -> None:
    """A gateway just started may not know its workers yet: one completion goes through first."""
    deadline = time.monotonic() + 60
    body = {"model": MODEL, "prompt": "ready", "max_tokens": 1}
    while (await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {api_key}"})).is_error:
        assert time.monotonic() < deadline, "the new gateway did not answer a completion within 60 s"
        await asyncio.sleep(0.2)


def _tokens_produced(metrics_port: int) -> float:
    """Inter-token gaps the gateway observed: one per output token after each request's first."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("diptych_gateway_inter_token_latency_seconds_count")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)
