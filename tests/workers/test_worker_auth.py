"""Only the gateway and other workers may call a worker: every call but health carries the worker RPC
secret, and a prefill worker sends KV only to a worker that proves it holds the secret."""

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diptych_common.credential_server import worker_server
from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_common.worker_credential import (
    WorkerSecret,
    attach_worker_secret,
    new_challenge,
)
from gateway.fleet.channels import Channels
from tests.workers.conftest import prompts
from tests.workers.serving import SECRET, Worker, sampling
from workers.serving.server import Role

PROMPT = prompts([12], salt=3)[0]
CALLS = {
    "Generate": lambda stub, metadata: _drain(
        stub.Generate(
            worker_pb2.GenerateWork(request_id="g", prompt_token_ids=PROMPT, sampling=sampling(2)), metadata=metadata
        )
    ),
    "Decode": lambda stub, metadata: _drain(
        stub.Decode(
            worker_pb2.DecodeRequest(request_id="d", transfer_token=b"t" * 32, sampling=sampling(2), prompt_tokens=12),
            metadata=metadata,
        )
    ),
    "GetKvEndpoint": lambda stub, metadata: stub.GetKvEndpoint(worker_pb2.KvEndpointRequest(), metadata=metadata),
    "GetLoad": lambda stub, metadata: stub.GetLoad(worker_pb2.LoadRequest(), metadata=metadata),
    "WatchLoad": lambda stub, metadata: _first(stub.WatchLoad(worker_pb2.LoadRequest(), metadata=metadata)),
    "StreamTokens": lambda stub, metadata: _first(
        stub.StreamTokens(worker_pb2.TokenStreamRequest(stream_id="s"), metadata=metadata)
    ),
}


async def _drain(call):
    return [event async for event in call]


async def _first(call):
    try:
        return await call.read()
    finally:
        call.cancel()


def prefill_call(decode_address: str):
    return lambda stub, metadata: _drain(
        stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="p",
                prompt_token_ids=PROMPT,
                sampling=sampling(2),
                decode_address=decode_address,
                transfer_token=b"t" * 32,
            ),
            metadata=metadata,
        )
    )


@pytest.fixture
async def pair(tiny_model, executor):
    prefill = Worker(Role.PREFILL, tiny_model, executor, allow_shm=False)
    decode = Worker(Role.DECODE, tiny_model, executor, allow_shm=False)
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


def raw_stub(worker) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(worker.unauthenticated)


@pytest.fixture
async def raw_channels(pair):
    for worker in pair:
        worker.unauthenticated = grpc.aio.insecure_channel(worker.address)
    yield
    for worker in pair:
        await worker.unauthenticated.close()


@pytest.mark.parametrize(
    "metadata",
    [None, (("authorization", "Bearer not-the-secret"),), (("authorization", SECRET),)],
    ids=["no-credential", "wrong-secret", "no-bearer-scheme"],
)
@pytest.mark.parametrize("method", [*CALLS, "Prefill"])
async def test_every_worker_call_without_the_secret_is_unauthenticated(pair, raw_channels, method, metadata):
    prefill, decode = pair
    worker = prefill if method in ("Prefill", "GetLoad", "WatchLoad") else decode
    call = prefill_call(decode.address) if method == "Prefill" else CALLS[method]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(raw_stub(worker), metadata)
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in raised.value.details() or "does not match" in raised.value.details()
    assert worker.engine.stats().waiting == worker.engine.stats().running == 0  # nothing ran
    assert decode.receiver.bytes_received == 0


async def test_the_secret_opens_the_same_calls(pair):
    prefill, decode = pair
    assert (await CALLS["GetLoad"](decode.stub, None)).worker_id == "decode-0"
    assert (await CALLS["WatchLoad"](prefill.stub, None)).worker_id == "prefill-0"
    assert [e.token_id for e in await CALLS["Generate"](decode.stub, None)]


async def serve_with_health(worker) -> str:
    """The worker's service and health on one server, as workers/main.py builds it."""
    server = worker_server(worker.secret)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker.service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    worker.extra_servers.append(server)
    return address


@pytest.fixture
async def unregistered(tiny_model, executor):
    worker = Worker(Role.DECODE, tiny_model, executor, allow_shm=False, secret="")
    worker.extra_servers = []
    yield worker
    for server in worker.extra_servers:
        await server.stop(None)


async def test_a_worker_that_has_not_registered_refuses_every_call_but_health(unregistered):
    address = await serve_with_health(unregistered)
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING  # probes hold no secret
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await worker_pb2_grpc.WorkerStub(channel).GetLoad(
                worker_pb2.LoadRequest(), metadata=(("authorization", "Bearer anything"),)
            )
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "not registered" in raised.value.details()
    unregistered.secret.set(SECRET)  # registration hands the secret over: calls with it now pass
    async with grpc.aio.insecure_channel(address, interceptors=attach_worker_secret(unregistered.secret)) as channel:
        assert (await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.LoadRequest())).worker_id == "decode-0"


async def test_the_kv_endpoint_carries_a_proof_of_the_secret_over_the_challenge(pair):
    _, decode = pair
    challenge = new_challenge()
    endpoint = await decode.stub.GetKvEndpoint(worker_pb2.KvEndpointRequest(challenge=challenge))
    assert WorkerSecret(SECRET).proves(challenge, endpoint)
    assert not WorkerSecret("another deployment's secret").proves(challenge, endpoint)
    assert not WorkerSecret(SECRET).proves(new_challenge(), endpoint)  # a replayed answer fails
    endpoint.data_port += 1  # the proof covers where the KV goes
    assert not WorkerSecret(SECRET).proves(challenge, endpoint)


async def test_a_prefill_worker_sends_no_kv_to_a_worker_that_cannot_prove_the_secret(tiny_model, executor, pair):
    """An impostor answers GetKvEndpoint to anyone (it checks no credential) but holds another secret:
    the prefill worker refuses it before any KV leaves."""
    prefill, _ = pair
    impostor = Worker(Role.DECODE, tiny_model, executor, allow_shm=False, secret="an impostor's secret")
    impostor.server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(impostor.service, impostor.server)
    impostor.receiver.start()
    address = f"127.0.0.1:{impostor.server.add_insecure_port('127.0.0.1:0')}"
    await impostor.server.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await prefill_call(address)(prefill.stub, None)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "could not prove it is a registered decode worker" in raised.value.details()
        assert impostor.receiver.bytes_received == 0 and prefill.sender.bytes_sent == 0
        assert prefill.engine.connector.peer(address) is None
    finally:
        await impostor.server.stop(None)
        impostor.receiver.close()


async def test_the_gateways_channels_carry_the_secret_handed_over_after_they_were_made(pair):
    _, decode = pair
    channels = Channels()
    try:
        stub = channels.stub(decode.address)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.GetLoad(worker_pb2.LoadRequest(), metadata=channels.metadata())
        assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
        channels.secret.set(SECRET)
        assert (await stub.GetLoad(worker_pb2.LoadRequest(), metadata=channels.metadata())).worker_id == "decode-0"
        work = worker_pb2.GenerateWork(request_id="g", prompt_token_ids=PROMPT, sampling=sampling(2))
        events = await _drain(stub.Generate(work, metadata=channels.metadata()))
        assert events[-1].finished
    finally:
        await channels.close()
