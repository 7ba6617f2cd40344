"""A control plane that is down for longer than a worker's heartbeat deadline costs no request: the
gateway keeps routing to the workers it sees reporting load, through the outage and in the moment after
it, when the control plane's registry lists no worker live until each heartbeats again."""

import asyncio
import time

import grpc

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc

OUTAGE_S = 12.0  # longer than DIPTYCH_WORKER_DEAD_AFTER_SECONDS (10)
AFTER_S = 4.0  # two heartbeat intervals past its return
# Each client's pause between requests: a steady flow through the outage (about 8 requests a second in all)
# that stays inside the organization's default limit of 500 requests a minute, which the suite's other
# tests share.
PACE_S = 0.25


def test_requests_keep_succeeding_through_a_control_plane_outage_and_right_after_it(live):
    stack = live.stack
    outcomes: list[grpc.StatusCode] = []

    async def load(until: asyncio.Event):
        address = live.gateways["split"].removeprefix("grpc://")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(model="diptych-tiny", prompt="through the outage", max_tokens=2)
            while not until.is_set():
                try:
                    async for _ in stub.Generate(
                        request, metadata=(("authorization", f"Bearer {live.api_key}"),), timeout=30
                    ):
                        pass
                    outcomes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    outcomes.append(error.code())
                await asyncio.sleep(PACE_S)

    async def outage():
        done = asyncio.Event()
        clients = [asyncio.create_task(load(done)) for _ in range(2)]
        deadline = time.monotonic() + 30
        while len(outcomes) < 4:  # requests are flowing before the outage begins
            assert time.monotonic() < deadline, f"no traffic before the outage: {outcomes}"
            await asyncio.sleep(0.05)
        stack.kill_process("control-plane")
        await asyncio.sleep(OUTAGE_S)  # the outage's length is what this test is about
        stack.restart_process("control-plane")
        await asyncio.to_thread(stack.wait_for_control_plane)
        back = len(outcomes)
        await asyncio.sleep(AFTER_S)  # so are the seconds right after it
        done.set()
        await asyncio.gather(*clients)
        return back

    back = asyncio.run(outage())
    failures = [code for code in outcomes if code is not grpc.StatusCode.OK]
    assert len(outcomes) > back + 4, "requests ran after the control plane came back"
    assert failures == [], f"{len(failures)} of {len(outcomes)} requests failed: {set(failures)}"
