"""A request whose client goes away before it runs frees what it holds: its idempotency key (else a retry
meets "still running" until the key's lease ends, 5 minutes for 24 tokens) and the output tokens it
reserved. The window seen in CI: a batch runner killed while the gateway claimed a line's key at the
control plane; the restarted runner's retries got 409 for longer than the test waited."""

import asyncio
import json
from dataclasses import dataclass

import grpc
import pytest

from diptych_proto.v1 import inference_pb2
from gateway.accounts.limits import RateLimiter, Reservation
from gateway.types import GenerationRequest
from tests.gateway.harness import (
    API_KEY,
    GENERATE_METHOD,
    MODEL,
    ControlPlaneInMemory,
    InProcessGateway,
    in_process_gateway,
)

KEY = "the-key"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class ControlPlaneKeepingKeys(ControlPlaneInMemory):
    """Idempotency keys as the control plane keeps them; a claim is taken at once and answered only once
    `answer_claims` is set, as a slow control plane's would be."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, str] = {}  # key -> execution id
        self.claimed = asyncio.Event()
        self.answer_claims = asyncio.Event()
        self.released: list[str] = []

    async def claim_idempotency_key(self, body: dict) -> dict:
        holder = self.held.setdefault(body["key"], body["execution_id"])
        self.claimed.set()
        await self.answer_claims.wait()
        if holder != body["execution_id"]:
            return {"outcome": "in_flight", "execution_id": holder}
        return {"outcome": "claimed", "execution_id": holder}

    async def release_idempotency_key(self, body: dict) -> dict:
        released = self.held.get(body["key"]) == body["execution_id"]
        if released:
            del self.held[body["key"]]
            self.released.append(body["execution_id"])
        return {"released": released}


class SettlingLimiter(RateLimiter):
    """The gateway's limiter, noting each reservation it settles."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[tuple[Reservation, int]] = []

    async def settle(self, reservation: Reservation, output_tokens: int) -> None:
        self.settled.append((reservation, output_tokens))
        await super().settle(reservation, output_tokens)


@dataclass
class Gateway:
    inside: InProcessGateway
    control_plane: ControlPlaneKeepingKeys
    limiter: SettlingLimiter


@pytest.fixture
async def gateway(tmp_path):
    control_plane, limiter = ControlPlaneKeepingKeys(), SettlingLimiter()
    async with in_process_gateway(tmp_path, control_plane, limiter) as inside:
        yield Gateway(inside, control_plane, limiter)


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def http_request(path: str, body: dict, headers: dict[str, str]) -> bytes:
    content = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json"]
    head += [f"Content-Length: {len(content)}", f"Idempotency-Key: {KEY}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + content


BEARER = {"Authorization": f"Bearer {API_KEY}"}
REQUESTS = {
    "chat": ("/v1/chat/completions", CHAT, BEARER),
    "chat stream": ("/v1/chat/completions", {**CHAT, "stream": True}, BEARER),
    "completion": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}, BEARER),
    "messages": ("/v1/messages", {**CHAT, "stream": True}, {"x-api-key": API_KEY}),
}


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_a_client_gone_while_its_key_is_claimed_frees_the_key(gateway, name):
    path, body, headers = REQUESTS[name]
    control_plane = gateway.control_plane
    _, writer = await asyncio.open_connection("127.0.0.1", gateway.inside.http.server.port)
    writer.write(http_request(path, body, headers))
    await asyncio.wait_for(control_plane.claimed.wait(), 10)
    writer.close()  # the client goes away while the control plane takes the claim
    await writer.wait_closed()
    await until(lambda: not control_plane.held)
    assert len(control_plane.released) == 1
    limiter = gateway.limiter
    await until(lambda: limiter.settled)
    assert [tokens for _, tokens in limiter.settled] == [0]


async def test_a_grpc_call_cancelled_while_its_key_is_claimed_frees_the_key(gateway):
    control_plane = gateway.control_plane
    request = inference_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, idempotency_key=KEY)
    call = gateway.inside.channel.unary_stream(
        GENERATE_METHOD, request_serializer=inference_pb2.GenerateRequest.SerializeToString
    )(request, metadata=(("authorization", f"Bearer {API_KEY}"),))
    await asyncio.wait_for(control_plane.claimed.wait(), 10)
    call.cancel()
    await until(lambda: not control_plane.held)
    assert len(control_plane.released) == 1
    assert await call.code() is grpc.StatusCode.CANCELLED


async def test_a_request_abandoned_after_admission_frees_its_key_once_and_cannot_run(gateway):
    control_plane, pipeline = gateway.control_plane, gateway.inside.pipeline
    control_plane.answer_claims.set()
    request = GenerationRequest(model=MODEL, prompt="hi", max_tokens=4, idempotency_key=KEY)
    admitted = await pipeline.admit(f"Bearer {API_KEY}", request, "http")
    assert control_plane.held == {KEY: admitted.plan.request_id}
    pipeline.abandon(admitted)
    pipeline.abandon(admitted)
    await until(lambda: not control_plane.held)
    await until(lambda: gateway.limiter.settled)
    assert control_plane.released == [admitted.plan.request_id]
    assert [tokens for _, tokens in gateway.limiter.settled] == [0]
    with pytest.raises(RuntimeError, match="already run or abandoned"):
        async for _ in pipeline.generate(admitted):
            pass


async def test_a_request_that_ran_is_not_freed_again_when_abandoned(gateway):
    """Past the door the harness's fleet has no workers: the run fails UNAVAILABLE and frees its key."""
    control_plane, pipeline = gateway.control_plane, gateway.inside.pipeline
    control_plane.answer_claims.set()
    request = GenerationRequest(model=MODEL, prompt="hi", max_tokens=4, idempotency_key=KEY)
    admitted = await pipeline.admit(f"Bearer {API_KEY}", request, "http")
    with pytest.raises(Exception, match="no ready"):
        async for _ in pipeline.generate(admitted):
            pass
    pipeline.abandon(admitted)
    await until(lambda: not control_plane.held)
    await asyncio.sleep(0.1)
    assert control_plane.released == [admitted.plan.request_id]
    assert len(gateway.limiter.settled) == 1
