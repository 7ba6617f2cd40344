"""The chaos run's interactive traffic: a few concurrent clients per organization, each streaming one
completion after another through the gateway's gRPC API, and a record of what each request delivered."""

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import grpc.aio

from bench.chaos.ledger import RequestRecord
from bench.workload import FIRST_ORDINARY_TOKEN
from diptych_common.builtin import DIPTYCH_TINY
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from diptych_server.stack import StackError

MODEL = "diptych-tiny"
ERROR_BACKOFF_S = 0.25  # a client whose request failed before any token waits this long
ERROR_MESSAGE_CHARS = 160
# The clients reconnect to a restarted gateway within a second, as a well-configured client would; gRPC's
# default backoff grows to two minutes, which would measure the client's patience, not the platform.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True)
class LoadSettings:
    clients_per_organization: int
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    request_timeout_s: float


class Load:
    """Concurrent streaming clients per organization, each sending its next request when the last ended."""

    def __init__(self, gateway_address: str, api_keys: dict[str, str], settings: LoadSettings, seed: int) -> None:
        self._gateway_address = gateway_address
        self._api_keys = api_keys  # organization id -> API key
        self._settings = settings
        self._seed = seed
        self.records: list[RequestRecord] = []
        self.error_messages: Counter[str] = Counter()  # "CODE: details" -> requests
        self.started = time.monotonic()
        self.seconds = 0.0  # how long the load ran, the tail after the last restart included
        self.until = self.started  # clients send while the clock is before this; the chaos may extend it

    async def warm_up(self, timeout_s: float) -> None:
        """One completed request per organization before the clock starts: the gateway has seen the workers
        and every key works. These requests are recorded and reconciled like the others."""
        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(self._gateway_address, options=CHANNEL_OPTIONS) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            rng = random.Random(f"{self._seed}:warm-up")
            for organization_id, api_key in self._api_keys.items():
                while not (await self._one_request(stub, organization_id, api_key, rng)).completed:
                    if time.monotonic() > deadline:
                        raise StackError(
                            f"no request of {organization_id} completed within {timeout_s:.0f} s: "
                            f"{dict(self.error_messages.most_common(3))}"
                        )
                    await asyncio.sleep(ERROR_BACKOFF_S)

    async def run(self, duration_s: float) -> None:
        now = time.monotonic()
        for record in self.records:  # the warm-up's, before the clock starts: negative times
            record.sent_at_s -= now - self.started
        self.started = now
        self.until = self.started + duration_s
        async with grpc.aio.insecure_channel(self._gateway_address, options=CHANNEL_OPTIONS) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            clients = [
                self._client(stub, organization_id, api_key, random.Random(f"{self._seed}:{organization_id}:{i}"))
                for organization_id, api_key in self._api_keys.items()
                for i in range(self._settings.clients_per_organization)
            ]
            await asyncio.gather(*clients)
        self.seconds = time.monotonic() - self.started

    async def _client(self, stub, organization_id: str, api_key: str, rng: random.Random) -> None:
        while time.monotonic() < self.until:
            record = await self._one_request(stub, organization_id, api_key, rng)
            if not record.completed and record.delivered_tokens == 0:
                await asyncio.sleep(ERROR_BACKOFF_S)

    async def _one_request(self, stub, organization_id: str, api_key: str, rng: random.Random) -> RequestRecord:
        prompt = [
            rng.randrange(FIRST_ORDINARY_TOKEN, DIPTYCH_TINY.llama_config["vocab_size"])
            for _ in range(rng.randint(*self._settings.prompt_tokens))
        ]
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
            max_tokens=rng.randint(*self._settings.max_tokens),
            temperature=0.0,
            ignore_eos=True,
        )
        record = RequestRecord(organization_id, len(prompt), time.monotonic() - self.started)
        self.records.append(record)
        call = stub.Generate(
            request, metadata=(("authorization", f"Bearer {api_key}"),), timeout=self._settings.request_timeout_s
        )
        try:
            async for message in call:
                record.request_id = record.request_id or message.request_id
                record.delivered_tokens += len(message.token_ids)
                if message.HasField("usage"):
                    record.usage_completion_tokens = message.usage.completion_tokens
            record.completed = True
        except grpc.aio.AioRpcError as error:
            record.error = error.code().name
            self.error_messages[f"{record.error}: {(error.details() or '')[:ERROR_MESSAGE_CHARS]}"] += 1
            record.request_id = record.request_id or _metadata_request_id(error.trailing_metadata())
        return record


def _metadata_request_id(metadata) -> str:
    return next((value for key, value in (metadata or ()) if key == "request-id"), "")
