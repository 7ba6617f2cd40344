"""Token streams: the tokens of every call that names one come over it, a message per engine step holding
every such call's new tokens, equal to what the calls' own streams carry; a call cannot name a stream
that is not open, nor outlive the stream it names."""

import asyncio
import json
import secrets

import grpc
import pytest

from diptych_common.proto.v1 import worker_pb2
from gateway.fleet.channels import Channels
from gateway.fleet.token_streams import CallTokens, WorkerTokenStream
from gateway.routing.route import ServingMode
from tests.gateway.harness import MODEL, post_json
from tests.workers.conftest import prompts
from tests.workers.serving import SECRET, Worker, sampling
from tests.workers.test_gateway_sampling_controls import COLOCATED, SPLIT, gateway_over
from workers.serving.server import Role

PROMPTS = prompts([9, 14, 5, 20, 11, 7], salt=21)
COUNT = 12


@pytest.fixture
async def colocated(tiny_model, executor):
    worker = Worker(Role.COLOCATED, tiny_model, executor, allow_shm=False)
    await worker.start()
    yield worker
    await worker.stop()


def work(index: int, prompt: list[int], stream_id: str = "") -> worker_pb2.GenerateWork:
    return worker_pb2.GenerateWork(
        request_id=f"r{index}", prompt_token_ids=prompt, sampling=sampling(COUNT), token_stream=stream_id
    )


async def own_stream_tokens(worker, index: int, prompt: list[int]) -> list[int]:
    return [event.token_id async for event in worker.stub.Generate(work(index, prompt))]


async def test_concurrent_calls_get_their_tokens_batched_on_the_stream_and_equal_their_own_streams(colocated):
    expected = [await own_stream_tokens(colocated, i, prompt) for i, prompt in enumerate(PROMPTS)]
    stream_id = secrets.token_hex(16)
    stream = colocated.stub.StreamTokens(worker_pb2.TokenStreamRequest(stream_id=stream_id))
    assert list((await stream.read()).tokens) == []  # open: calls may name it
    calls = [colocated.stub.Generate(work(i, prompt, stream_id)) for i, prompt in enumerate(PROMPTS)]
    received: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    batch_sizes = []
    while sum(map(len, received.values())) < COUNT * len(PROMPTS):
        batch = await asyncio.wait_for(stream.read(), 30)
        batch_sizes.append(len(batch.tokens))
        for token in batch.tokens:
            received[token.request_id].append(token.event.token_id)
    assert [[e async for e in call] for call in calls] == [[] for _ in calls]  # their own streams carry none
    stream.cancel()
    assert [received[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert max(batch_sizes) > 1, "every step's tokens of all calls go out together"
    assert len(batch_sizes) < COUNT * len(PROMPTS) / 2, batch_sizes


async def test_a_call_naming_a_stream_that_is_not_open_is_refused(colocated):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [e async for e in colocated.stub.Generate(work(0, PROMPTS[0], "never-opened"))]
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "StreamTokens" in refused.value.details()


async def test_a_stream_id_in_use_is_refused(colocated):
    stream_id = secrets.token_hex(16)
    first = colocated.stub.StreamTokens(worker_pb2.TokenStreamRequest(stream_id=stream_id))
    await first.read()
    second = colocated.stub.StreamTokens(worker_pb2.TokenStreamRequest(stream_id=stream_id))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await second.read()
    assert refused.value.code() is grpc.StatusCode.ALREADY_EXISTS
    first.cancel()


async def test_a_call_whose_stream_closes_fails_and_frees_its_blocks(colocated):
    stream_id = secrets.token_hex(16)
    stream = colocated.stub.StreamTokens(worker_pb2.TokenStreamRequest(stream_id=stream_id))
    await stream.read()
    long_work = worker_pb2.GenerateWork(
        request_id="long", prompt_token_ids=PROMPTS[0], sampling=sampling(400), token_stream=stream_id
    )
    call = colocated.stub.Generate(long_work)
    await asyncio.wait_for(stream.read(), 30)  # it runs
    stream.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await asyncio.wait_for(call.read(), 30)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    for _ in range(100):  # the engine drops the aborted request at its next step
        stats = colocated.engine.stats()
        if stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
            break
        await asyncio.sleep(0.05)
    assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def test_the_gateway_reads_a_calls_tokens_from_the_workers_stream(colocated):
    channels = Channels()
    channels.secret.set(SECRET)
    try:
        stream = await channels.token_stream(colocated.address, 10)
        assert stream is not None
        assert await channels.token_stream(colocated.address, 10) is stream  # one per worker
        call = channels.stub(colocated.address).Generate(
            work(0, PROMPTS[1], stream.stream_id), metadata=channels.metadata()
        )
        tokens = CallTokens(call, stream, "r0")
        events = [await tokens.read() for _ in range(COUNT)]
        tokens.close()
        assert [e.token_id for e in events] == await own_stream_tokens(colocated, 0, PROMPTS[1])
        assert events[-1].finished and not any(e.finished for e in events[:-1])
    finally:
        await channels.close()


async def test_a_worker_that_serves_no_token_streams_gets_calls_that_carry_their_own(colocated):
    """A worker of a version before token streams: its server answers StreamTokens UNIMPLEMENTED."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        channels = Channels()
        assert await channels.token_stream(f"127.0.0.1:{port}", 10) is None
        await channels.close()
    finally:
        await server.stop(None)


async def test_a_broken_stream_fails_every_call_reading_from_it(colocated):
    channels = Channels()
    channels.secret.set(SECRET)
    try:
        stream = await channels.token_stream(colocated.address, 10)
        assert isinstance(stream, WorkerTokenStream)
        long_work = worker_pb2.GenerateWork(
            request_id="long", prompt_token_ids=PROMPTS[2], sampling=sampling(400), token_stream=stream.stream_id
        )
        call = channels.stub(colocated.address).Generate(long_work, metadata=channels.metadata())
        tokens = CallTokens(call, stream, "long")
        await tokens.read()
        await colocated.server.stop(None)  # the worker goes away
        with pytest.raises(grpc.aio.AioRpcError):
            while (await asyncio.wait_for(tokens.read(), 30)) is not grpc.aio.EOF:
                pass
        tokens.close()
    finally:
        await channels.close()


@pytest.mark.parametrize("mode", ["split", "colocated"])
async def test_the_gateways_requests_take_their_tokens_from_the_workers_streams(tmp_path, tiny_model, executor, mode):
    """Every token after the first (which a prefill worker samples in split mode) comes over the worker's
    token stream."""
    roles, serving = (SPLIT, ServingMode.SPLIT) if mode == "split" else (COLOCATED, ServingMode.COLOCATED)
    bodies = [
        json.dumps({"model": MODEL, "prompt": f"streams {i} " * (3 + i), "max_tokens": 10, "ignore_eos": True})
        for i in range(4)
    ]
    async with gateway_over(tmp_path, tiny_model, executor, roles, serving) as (gateway, workers):
        answers = await asyncio.gather(*(post_json(gateway, "/v1/completions", body.encode()) for body in bodies))
        streamed = sum(worker.service.token_streams.tokens_streamed for worker in workers.values())
    assert [status for status, _ in answers] == [200] * len(bodies), answers
    assert [payload["usage"]["completion_tokens"] for _, payload in answers] == [10] * len(bodies)
    assert streamed == len(bodies) * (10 - 1 if mode == "split" else 10)
