"""The failed-authentication budget on the wire: the HTTP and gRPC front doors name the caller's address,
so a peer that keeps sending bad keys gets 429 / RESOURCE_EXHAUSTED with the time to wait."""

import grpc

from gateway.accounts.auth import FAILED_AUTH_BURST
from tests.gateway.harness import GENERATE_METHOD, in_process_gateway

BODY = b'{"model": "diptych-tiny", "prompt": "hi", "max_tokens": 1}'


async def test_http_callers_over_their_failure_budget_get_429_with_retry_after(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        headers = {"Authorization": "Bearer dip_wrong", "Content-Type": "application/json"}
        statuses = []
        for _ in range(FAILED_AUTH_BURST + 1):
            async with gateway.http.post("/v1/completions", data=BODY, headers=headers) as response:
                statuses.append(response.status)
                retry_after = response.headers.get("Retry-After")
                message = (await response.json())["error"]["message"]
        assert statuses == [401] * FAILED_AUTH_BURST + [429]
        assert "too many failed authentications from 127.0.0.1" in message  # the caller's address
        assert retry_after is not None and int(retry_after) >= 1
        assert gateway.path.runs == 0


async def test_grpc_callers_over_their_failure_budget_get_resource_exhausted(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        codes, trailers, message = [], None, ""
        for _ in range(FAILED_AUTH_BURST + 1):
            call = gateway.channel.unary_stream(GENERATE_METHOD)(b"", metadata=(("authorization", "Bearer dip_wrong"),))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
                trailers, message = dict(error.trailing_metadata() or ()), error.details()
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * FAILED_AUTH_BURST + [grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert int(trailers["retry-after-ms"]) > 0
        assert "too many failed authentications from 127.0.0.1" in message  # the caller's address
