"""The gateway in front of two prefill and two decode workers: prefix affinity, load spreading, and
every failure path: a prefill worker that dies before its KV cache arrived, a decode worker killed
mid-stream, a client that cancels or disconnects, a drain on SIGTERM, and a control-plane outage
during which usage is spooled and later replayed exactly once.

Its own platform (control plane, four workers, gateways), since these tests kill processes.
"""

import asyncio
import signal
import time
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diptych_common.prefix_hash import block_hashes
from diptych_common.proto.v1 import worker_pb2
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from diptych_server.stack import Stack
from gateway.fleet.live_load import STALE_AFTER_S
from tests.e2e.conftest import CancellationWatch, free_port, own_database, worker_load
from tests.e2e.test_generation import generate_reference

MODEL = "diptych-tiny"
WORKER_TIMEOUT_S = "5"
SERVING = health_pb2.HealthCheckResponse.SERVING


class Fleet:
    def __init__(self, stack: Stack, credentials) -> None:
        self.stack = stack
        self.credentials = credentials
        self.workers: dict[str, dict] = {}
        self.worker_metrics_urls: dict[str, str] = {}
        self.gateway_port = free_port()
        self.metrics_url = ""
        self.http_url = ""

    def start_workers(self, *names: str) -> None:
        for name in names:
            role, metrics_port = name.split("-")[0], free_port()
            self.stack.start_worker(
                name, role, self.credentials.fleet_tokens[role], free_port(), "--metrics-port", str(metrics_port)
            )
            self.worker_metrics_urls[name] = f"http://127.0.0.1:{metrics_port}/metrics"
        for name, entry in zip(names, self.stack.wait_for_workers(list(names)), strict=True):
            self.workers[name] = entry

    def start_gateway(self, name: str, port: int, **env: str) -> tuple[str, str]:
        metrics_port, http_port = free_port(), free_port()
        self.stack.start_gateway(
            name,
            port,
            metrics_port,
            "split",
            http_port=http_port,
            extra=(
                "--skip-split-below",
                "0",
                "--worker-timeout",
                WORKER_TIMEOUT_S,
                "--token-timeout",
                WORKER_TIMEOUT_S,
            ),
            **env,
        )
        return f"http://127.0.0.1:{metrics_port}/metrics", f"http://127.0.0.1:{http_port}/v1"

    def names(self, role: str) -> list[str]:
        return sorted(n for n in self.workers if n.startswith(role))

    def load(self, name: str) -> worker_pb2.Load:
        return worker_load(self.stack, self.workers[name]["address"])

    def watch_cancellation(self, max_tokens: int) -> CancellationWatch:
        urls = {name: self.worker_metrics_urls[name] for name in self.workers}
        return CancellationWatch(self.stack, self.workers, urls, max_tokens)

    def current_id(self, name: str) -> str:
        """The worker's id now (a worker registers again, under a new id, after being marked dead)."""
        entries = [w for w in self.stack.registry().json()["workers"] if w["name"] == name and w["state"] != "dead"]
        assert len(entries) == 1, entries
        return entries[0]["id"]

    def name_of(self, worker_id: str) -> str:
        return next(n for n, w in self.workers.items() if w["id"] == worker_id)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.metrics_url, timeout=5).text
        total = 0.0
        for line in text.splitlines():
            named = line.startswith((name + " ", name + "{"))
            if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.split()[-1])
        return total

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{self.gateway_port}")

    @property
    def auth(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.credentials.api_key}"),)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with own_database(tmp_path_factory.mktemp("fleet-db")) as database_url:
        stack = Stack(tmp_path_factory.mktemp("fleet"), control_plane_port=free_port(), database_url=database_url)
        yield from _run_fleet(stack)


def _run_fleet(stack: Stack):
    try:
        credentials = stack.prepare_control_plane(demo=True)
        stack.start_control_plane()
        fleet = Fleet(stack, credentials)
        fleet.start_workers("prefill-0", "prefill-1", "decode-0", "decode-1")
        fleet.metrics_url, fleet.http_url = fleet.start_gateway("gateway", fleet.gateway_port)
        yield fleet
    finally:
        stack.stop()


def request(prompt: list[int], max_tokens: int, **fields) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=inference_pb2.TokenIds(ids=prompt), max_tokens=max_tokens, temperature=0, **fields
    )


@dataclass
class Completion:
    tokens: list[int]
    usage: inference_pb2.Usage
    request_id: str


async def complete(fleet: Fleet, prompt: list[int], max_tokens: int) -> Completion:
    async with fleet.channel() as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tokens, usage, request_id = [], None, ""
        async for response in stub.Generate(request(prompt, max_tokens), metadata=fleet.auth, timeout=60):
            tokens.extend(response.token_ids)
            request_id = response.request_id
            usage = response.usage if response.HasField("usage") else usage
    return Completion(tokens, usage, request_id)


def long_prompt(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


async def test_a_repeated_long_prefix_goes_to_the_prefill_worker_that_holds_it(fleet):
    block_size = fleet.load("prefill-0").block_size
    assert block_size, "the prefill workers publish no prefix cache (Load.block_size is 0)"
    prefix = long_prompt(1, 320)
    holder = (await complete(fleet, [*prefix, 5, 6, 7], 2)).usage.prefill.worker_id
    deadline = time.monotonic() + 5  # the holder publishes the prefix's blocks in its next load report
    last_block = block_hashes(prefix, block_size, fleet.credentials.organization_id)[-1]  # salted per organization
    while last_block not in fleet.load(fleet.name_of(holder)).prefix_cache.block_hashes:
        assert time.monotonic() < deadline, "the prefill worker never published the prompt's blocks"
        await asyncio.sleep(0.05)
    for suffix in ([9, 10], [11, 12, 13], [14]):
        usage = (await complete(fleet, prefix + suffix, 2)).usage
        assert usage.prefill.worker_id == holder
        assert usage.cached_tokens >= 320 - block_size


async def test_a_hot_prefix_holder_sheds_requests_to_the_other_worker_and_keeps_its_affinity(fleet, reference):
    """The worker holding a prefix is kept busy (SIGSTOP, so none of its requests finishes) while eight
    requests sharing that prefix arrive: it takes the first few, then the queue outweighs the cached
    tokens and the rest go to the other worker. Once it is free again, the prefix goes back to it."""
    model, _ = reference
    block_size = fleet.load("prefill-0").block_size
    assert block_size, "the prefill workers publish no prefix cache (Load.block_size is 0)"
    prefix = long_prompt(2, 320)
    holder = (await complete(fleet, [*prefix, 5], 2)).usage.prefill.worker_id
    holder_name = fleet.name_of(holder)
    deadline = time.monotonic() + 5
    last_block = block_hashes(prefix, block_size, fleet.credentials.organization_id)[-1]  # salted per organization
    while last_block not in fleet.load(holder_name).prefix_cache.block_hashes:
        assert time.monotonic() < deadline, "the prefill worker never published the prompt's blocks"
        await asyncio.sleep(0.05)
    prompts = [[*prefix, 10 + i, 20 + i] for i in range(8)]
    routed_before = fleet.metric("diptych_gateway_routing_decisions_total")
    fleet.stack.processes[holder_name].send_signal(signal.SIGSTOP)
    try:
        pending = [asyncio.create_task(complete(fleet, prompt, 3)) for prompt in prompts]
        deadline = time.monotonic() + 30
        while fleet.metric("diptych_gateway_routing_decisions_total") < routed_before + len(prompts):
            assert time.monotonic() < deadline, "the gateway did not route all eight requests"
            await asyncio.sleep(0.02)
    finally:
        fleet.stack.processes[holder_name].send_signal(signal.SIGCONT)
    results = await asyncio.gather(*pending)
    on_holder = sum(r.usage.prefill.worker_id == holder for r in results)
    assert 2 <= on_holder <= 6, f"{on_holder} of 8 on the prefix holder"
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_reference(model, prompt, 3)
    assert (await complete(fleet, [*prefix, 99], 2)).usage.prefill.worker_id == holder


async def test_concurrent_requests_spread_over_both_prefill_and_decode_workers(fleet, reference):
    model, _ = reference
    prompts = [long_prompt(100 + i, 200) for i in range(8)]
    results = await asyncio.gather(*(complete(fleet, prompt, 8) for prompt in prompts))
    assert len({r.usage.prefill.worker_id for r in results}) == 2
    assert len({r.usage.decode.worker_id for r in results}) == 2
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_reference(model, prompt, 8)


# With its 60-token prompt, all of diptych-tiny's context: a stream cancelled after a few tokens is far from its end.
LONG_OUTPUT = 960


async def test_cancelling_a_grpc_stream_frees_the_sequence_on_both_workers(fleet):
    watch = fleet.watch_cancellation(LONG_OUTPUT)
    async with fleet.channel() as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request([7] * 60, LONG_OUTPUT, ignore_eos=True), metadata=fleet.auth, timeout=60
        )
        received = 0
        async for response in call:
            received += len(response.token_ids)
            if received >= 5:
                break
        call.cancel()
    await asyncio.to_thread(watch.assert_freed, 60)


async def test_an_http_client_that_disconnects_frees_the_sequence_on_both_workers(fleet):
    watch = fleet.watch_cancellation(LONG_OUTPUT)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST",
            f"{fleet.http_url}/completions",
            headers={"Authorization": f"Bearer {fleet.credentials.api_key}"},
            json={
                "model": MODEL,
                "prompt": [8] * 60,
                "max_tokens": LONG_OUTPUT,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            },
        ) as response,
    ):
        assert response.status_code == 200
        chunks = 0
        async for line in response.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 5:
                break
    await asyncio.to_thread(watch.assert_freed, 60)


async def test_a_worker_that_stops_reporting_gets_no_new_work(fleet):
    """decode-1 freezes (SIGSTOP): its load stream falls silent, and once its last report is older
    than the gateway's staleness limit, new requests go only to decode-0, with no failed attempt."""
    silent = fleet.names("decode")[1]
    retries_before = fleet.metric("diptych_gateway_retries_total")
    migrations_before = fleet.metric("diptych_gateway_decode_migrations_total")
    fleet.stack.processes[silent].send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(STALE_AFTER_S + 0.5)  # the staleness limit is what this test is about
        results = [await complete(fleet, [6] * (20 + i), 4) for i in range(4)]
    finally:
        fleet.stack.processes[silent].send_signal(signal.SIGCONT)
    assert {r.usage.decode.worker_id for r in results} == {fleet.current_id(fleet.names("decode")[0])}
    assert fleet.metric("diptych_gateway_retries_total") == retries_before
    assert fleet.metric("diptych_gateway_decode_migrations_total") == migrations_before


async def test_a_kv_hand_off_that_never_completes_moves_the_request_to_another_pair(fleet, reference):
    """decode-0 freezes (SIGSTOP) while two requests are routed, one to each decode worker: the one on
    decode-0 gets its first token from prefill, but its KV cache never arrives, so after the gateway's
    deadline it runs again on the other pair, continuing after that first token."""
    model, _ = reference
    frozen = fleet.names("decode")[0]
    frozen_id = fleet.current_id(frozen)
    migrations_before = fleet.metric("diptych_gateway_decode_migrations_total")
    routed_before = fleet.metric("diptych_gateway_routing_decisions_total")
    prompts = [long_prompt(300 + i, 200) for i in range(2)]
    fleet.stack.processes[frozen].send_signal(signal.SIGSTOP)
    try:
        pending = [asyncio.create_task(complete(fleet, prompt, 6)) for prompt in prompts]
        results = await asyncio.gather(*pending)
    finally:
        fleet.stack.processes[frozen].send_signal(signal.SIGCONT)
    assert fleet.metric("diptych_gateway_routing_decisions_total") >= routed_before + 3  # one request ran twice
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_reference(model, prompt, 6)
        assert result.usage.decode.worker_id != frozen_id
    assert fleet.metric("diptych_gateway_decode_migrations_total") >= migrations_before + 1


async def test_a_prefill_worker_that_dies_before_its_kv_cache_arrived_is_retried_on_another(fleet, reference):
    """The prefill worker the router prefers on a tie (the lowest id) is frozen (SIGSTOP) with the fleet
    idle, so the first of two requests goes to it and the second, while the first is held there, to the
    other; then it is killed with that prompt unanswered: the gateway retries the prompt on the other."""
    model, _ = reference
    victim = min(fleet.names("prefill"), key=fleet.current_id)
    victim_id = fleet.current_id(victim)
    deadline = time.monotonic() + 10
    while fleet.metric("diptych_gateway_worker_queue_depth", role="prefill") > 0:
        assert time.monotonic() < deadline, "the prefill workers never reported an empty queue"
        await asyncio.sleep(0.05)
    retries_before = fleet.metric("diptych_gateway_retries_total", phase="prefill")
    prompts = [long_prompt(200 + i, 50) for i in range(2)]
    fleet.stack.processes[victim].send_signal(signal.SIGSTOP)
    try:
        pending = []
        for prompt in prompts:  # one at a time: the first is held on the victim when the second is routed
            routed_before = fleet.metric("diptych_gateway_routing_decisions_total")
            pending.append(asyncio.create_task(complete(fleet, prompt, 10)))
            while fleet.metric("diptych_gateway_routing_decisions_total") < routed_before + 1:
                assert time.monotonic() < deadline + 10, "the gateway did not route the request"
                await asyncio.sleep(0.02)
    finally:
        fleet.stack.stop_process(victim, signal.SIGKILL)
    results = await asyncio.gather(*pending)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_reference(model, prompt, 10)
        assert result.usage.prefill.worker_id != victim_id
    assert fleet.metric("diptych_gateway_retries_total", phase="prefill") >= retries_before + 1
    fleet.workers.pop(victim)


async def test_a_decode_worker_killed_mid_stream_is_replaced_without_a_repeated_or_missing_token(fleet, reference):
    model, _ = reference
    prompt = long_prompt(7, 40)
    max_tokens = 300
    expected = generate_reference(model, prompt, max_tokens)
    migrations_before = fleet.metric("diptych_gateway_decode_migrations_total")
    received, usage, killed, request_id = [], None, None, ""
    async with fleet.channel() as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request(prompt, max_tokens), metadata=fleet.auth, timeout=120
        )
        async for response in call:
            request_id = response.request_id
            received.extend(response.token_ids)
            if response.HasField("usage"):
                usage = response.usage
            if killed is None and len(received) >= 20:
                killed = serving_decode_worker(fleet)
                killed_id = fleet.current_id(killed)
                fleet.stack.stop_process(killed, signal.SIGKILL)
    assert killed is not None and len(received) > 20
    assert received == expected  # no token repeated, none missing
    assert usage.completion_tokens == len(expected)
    assert usage.decode.worker_id != killed_id
    assert fleet.metric("diptych_gateway_decode_migrations_total") == migrations_before + 1
    fleet.workers.pop(killed)
    # Billed once: the prompt by the first prefill (its re-run is the platform's cost), every token by decode.
    events = await ledger_events(fleet, request_id, expected=2)
    assert {e["phase"]: e["tokens"] for e in events} == {"prefill": len(prompt), "decode": len(expected)}


async def ledger_events(fleet: Fleet, request_id: str, expected: int, seconds: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + seconds
    with httpx.Client(
        base_url=f"{fleet.stack.control_plane_url}/api/v1",
        headers={"Authorization": f"Bearer {fleet.credentials.api_key}"},
        timeout=10,
    ) as rest:
        while True:
            events = rest.get("/usage-events", params={"request_id": request_id}).json()["data"]
            if len(events) >= expected or time.monotonic() > deadline:
                return events
            await asyncio.sleep(0.1)


def serving_decode_worker(fleet: Fleet) -> str:
    busy = [name for name in fleet.names("decode") if fleet.load(name).active_sequences]
    assert len(busy) == 1, f"expected one decode worker serving the stream, found {busy}"
    return busy[0]


async def test_sigterm_drains_the_gateway_finishing_in_flight_streams_and_refusing_new_ones(fleet):
    port = free_port()
    fleet.start_gateway("gateway-drain", port)
    process = fleet.stack.processes["gateway-drain"]
    prompt, max_tokens = [9] * 30, 300
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request(prompt, max_tokens, ignore_eos=True), metadata=fleet.auth, timeout=120)
        received, finish = 0, None
        async for response in call:
            received += len(response.token_ids)
            if received == 3:
                process.send_signal(signal.SIGTERM)
                await wait_until_not_serving(channel)
                assert await refusal_of_a_new_request(stub, fleet.auth) is grpc.StatusCode.UNAVAILABLE
            finish = response.finish_reason or finish
    assert received == max_tokens and finish == inference_pb2.FINISH_REASON_LENGTH
    assert process.wait(timeout=30) == 0
    fleet.stack.processes.pop("gateway-drain")


async def refusal_of_a_new_request(stub, auth, attempts: int = 20) -> grpc.StatusCode:
    """The code a draining gateway refuses a new request with. A call that crosses the moment its server
    starts to stop may be cancelled by the server instead: such a call is sent again."""
    for _ in range(attempts):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(request([5], 2), metadata=auth, timeout=10):
                pass
        if refused.value.code() is not grpc.StatusCode.CANCELLED:
            return refused.value.code()
        await asyncio.sleep(0.05)
    return grpc.StatusCode.CANCELLED


async def wait_until_not_serving(channel: grpc.aio.Channel, seconds: float = 10.0) -> None:
    """Until the gateway has begun to drain: its health says NOT_SERVING, or its server already refuses new
    calls, health checks included (it stops taking calls right after turning NOT_SERVING)."""
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + seconds
    while True:
        try:
            if (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != SERVING:
                return
        except grpc.aio.AioRpcError:
            return
        assert time.monotonic() < deadline, f"the gateway still serves {seconds} s after SIGTERM"
        await asyncio.sleep(0.02)


async def test_usage_is_spooled_while_the_control_plane_is_down_and_replayed_exactly_once(fleet):
    await complete(fleet, [3, 4, 5], 1)  # the gateway has verified the key and keeps it through the outage
    fleet.stack.stop_process("control-plane")
    try:
        results = [await complete(fleet, [4] * (10 + i), 3 + i) for i in range(5)]
        spooled = fleet.metric("diptych_gateway_usage_events_spooled")
        deadline = time.monotonic() + 10
        while spooled < 10:
            assert time.monotonic() < deadline, f"only {spooled} events in the spool"
            await asyncio.sleep(0.1)
            spooled = fleet.metric("diptych_gateway_usage_events_spooled")
    finally:
        fleet.stack.start_control_plane()
    request_ids = [result.request_id for result in results]
    deadline = time.monotonic() + 20
    with httpx.Client(
        base_url=f"{fleet.stack.control_plane_url}/api/v1",
        headers={"Authorization": f"Bearer {fleet.credentials.api_key}"},
        timeout=10,
    ) as rest:
        while True:
            events = {rid: rest.get("/usage-events", params={"request_id": rid}).json()["data"] for rid in request_ids}
            if all(len(found) == 2 for found in events.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        while fleet.metric("diptych_gateway_usage_events_spooled") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        # The spool is empty and nothing more arrives: exactly one event per request and phase.
        events = {rid: rest.get("/usage-events", params={"request_id": rid}).json()["data"] for rid in request_ids}
    assert fleet.metric("diptych_gateway_usage_events_spooled") == 0
    for result in results:
        by_phase = {e["phase"]: e for e in events[result.request_id]}
        assert len(events[result.request_id]) == 2 and set(by_phase) == {"prefill", "decode"}
        assert by_phase["prefill"]["tokens"] == result.usage.prompt_tokens
        assert by_phase["decode"]["tokens"] == result.usage.completion_tokens == len(result.tokens)
