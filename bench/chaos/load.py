"""The chaos run's interactive traffic: a few concurrent clients per organization, each streaming one
completion after another through the SDK (`diptych.AsyncClient`, its own retry policy, every gateway in its
base URL), and a record of what each request delivered."""

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import diptych
from bench.chaos.ledger import RequestRecord
from bench.workload import FIRST_ORDINARY_TOKEN
from diptych_common.builtin import DIPTYCH_TINY
from diptych_server.stack import StackError

MODEL = "diptych-tiny"
ERROR_BACKOFF_S = 0.25  # a client whose request failed before any token waits this long
ERROR_MESSAGE_CHARS = 160


@dataclass(frozen=True)
class LoadSettings:
    clients_per_organization: int
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    request_timeout_s: float


class Load:
    """Concurrent streaming clients per organization, each sending its next request when the last ended."""

    def __init__(self, base_url: str, api_keys: dict[str, str], settings: LoadSettings, seed: int) -> None:
        self._base_url = base_url  # every gateway, comma-separated
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
        rng = random.Random(f"{self._seed}:warm-up")
        for organization_id, api_key in self._api_keys.items():
            async with self._client(api_key) as client:
                while not (await self._one_request(client, organization_id, rng)).completed:
                    if time.monotonic() > deadline:
                        raise StackError(
                            f"no request of {organization_id} completed within {timeout_s:.0f} s: "
                            f"{dict(self.error_messages.most_common(3))}"
                        )
                    await asyncio.sleep(ERROR_BACKOFF_S)

    def _client(self, api_key: str) -> diptych.AsyncClient:
        return diptych.AsyncClient(
            api_key=api_key,
            base_url=self._base_url,
            timeout=self._settings.request_timeout_s,
            stream_idle_timeout=self._settings.request_timeout_s,
        )

    async def run(self, duration_s: float) -> None:
        now = time.monotonic()
        for record in self.records:  # the warm-up's, before the clock starts: negative times
            record.sent_at_s -= now - self.started
        self.started = now
        self.until = self.started + duration_s
        clients = [
            self._streaming_client(organization_id, api_key, random.Random(f"{self._seed}:{organization_id}:{i}"))
            for organization_id, api_key in self._api_keys.items()
            for i in range(self._settings.clients_per_organization)
        ]
        await asyncio.gather(*clients)
        self.seconds = time.monotonic() - self.started

    async def _streaming_client(self, organization_id: str, api_key: str, rng: random.Random) -> None:
        async with self._client(api_key) as client:
            while time.monotonic() < self.until:
                record = await self._one_request(client, organization_id, rng)
                if not record.completed and record.delivered_tokens == 0:
                    await asyncio.sleep(ERROR_BACKOFF_S)

    async def _one_request(
        self, client: diptych.AsyncClient, organization_id: str, rng: random.Random
    ) -> RequestRecord:
        prompt = [
            rng.randrange(FIRST_ORDINARY_TOKEN, DIPTYCH_TINY.llama_config["vocab_size"])
            for _ in range(rng.randint(*self._settings.prompt_tokens))
        ]
        record = RequestRecord(organization_id, len(prompt), time.monotonic() - self.started)
        self.records.append(record)
        stream = None
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=rng.randint(*self._settings.max_tokens),
                temperature=0.0,
                ignore_eos=True,
                stream=True,
            )
            async with stream:
                async for chunk in stream:
                    record.delivered_tokens += len(chunk.token_ids)
                    record.interrupted = record.interrupted or chunk.finish_reason == "interrupted"
            record.request_id = stream.request_id or ""
            record.usage_completion_tokens = stream.usage.completion_tokens if stream.usage else None
            record.completed = True
        except diptych.DiptychError as error:
            record.error = error.code or type(error).__name__
            self.error_messages[f"{record.error}: {error.message[:ERROR_MESSAGE_CHARS]}"] += 1
            record.request_id = error.request_id or (stream.request_id if stream else None) or ""
        record.ended_at_s = time.monotonic() - self.started
        return record
