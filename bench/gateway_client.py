"""Drives the platform through its public gRPC API (the gateway), timing every streamed token.

It speaks the raw `diptych.v1.Inference` stub so that it can set `ignore_eos` (fixed output lengths)
and see each token's arrival; the SDK rides on the same stub.
"""

import asyncio
import time
import uuid
from collections.abc import Iterable

import grpc
import grpc.aio

from bench.stats import RequestResult
from bench.workload import BenchRequest
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc

REQUEST_TIMEOUT_S = 600.0


class GatewayClient:
    def __init__(
        self, address: str, api_key: str, model: str, temperature: float = 0.0, idempotency_keys: bool = False
    ) -> None:
        """`temperature` 0: greedy requests; above it, every request samples at it. `idempotency_keys`: each
        request carries a key of its own, as the SDK's do."""
        self._address = address.removeprefix("grpc://")
        self._temperature = temperature
        self._idempotency_keys = idempotency_keys
        self._metadata = (("authorization", f"Bearer {api_key}"),)
        self._model = model
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> "GatewayClient":
        self._channel = grpc.aio.insecure_channel(self._address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def generate(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        ignore_eos: bool = True,
        shares_prefix: bool = False,
        due_at: float | None = None,
    ) -> RequestResult:
        """One request (greedy unless the client samples); never raises for a failed call: the result
        carries the error. Latencies count from `due_at` (perf_counter) when given, so that a late send
        counts against the platform."""
        request = inference_pb2.GenerateRequest(
            model=self._model,
            prompt_token_ids=inference_pb2.TokenIds(ids=prompt_token_ids),
            max_tokens=max_tokens,
            temperature=self._temperature,
            ignore_eos=ignore_eos,
            idempotency_key=f"bench-{uuid.uuid4().hex}" if self._idempotency_keys else "",
        )
        stub = inference_pb2_grpc.InferenceStub(self._channel)
        result = RequestResult(sent_at=time.perf_counter() if due_at is None else due_at, shares_prefix=shares_prefix)
        try:
            async for message in stub.Generate(request, metadata=self._metadata, timeout=REQUEST_TIMEOUT_S):
                now = time.perf_counter()
                result.token_times.extend(now for _ in message.token_ids)
                result.token_ids.extend(message.token_ids)
                if message.HasField("usage"):
                    result.prompt_tokens = message.usage.prompt_tokens
                    result.cached_tokens = message.usage.cached_tokens
                    result.kv_bytes = message.usage.prefill.kv_bytes
                    result.prefill_worker = message.usage.prefill.worker_id
                    result.decode_worker = message.usage.decode.worker_id
        except grpc.aio.AioRpcError as error:
            result.error = f"{error.code().name}: {error.details()}"
        return result

    async def replay_open_loop(self, requests: list[BenchRequest]) -> list[RequestResult]:
        """Sends each request at its arrival time, whatever is still running (Poisson load)."""
        start = time.perf_counter()

        async def send(request: BenchRequest) -> RequestResult:
            due_at = start + request.arrival_s
            await asyncio.sleep(max(0.0, due_at - time.perf_counter()))
            return await self.generate(
                request.prompt_token_ids, request.output_tokens, shares_prefix=request.shares_prefix, due_at=due_at
            )

        return list(await asyncio.gather(*(send(r) for r in requests)))

    async def replay_closed_loop(self, requests: Iterable[BenchRequest], concurrency: int) -> list[RequestResult]:
        """`concurrency` clients, each sending its next request as soon as its previous one ended."""
        queue = list(requests)
        queue.reverse()
        results: list[RequestResult] = []

        async def client() -> None:
            while queue:
                request = queue.pop()
                results.append(
                    await self.generate(
                        request.prompt_token_ids, request.output_tokens, shares_prefix=request.shares_prefix
                    )
                )

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results
