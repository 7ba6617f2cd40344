"""The chaos run's Batch API traffic, sent through the gateway's OpenAI-compatible HTTP API while the
interactive load runs.

Each organization uploads a JSONL file of chat requests now and then (`/v1/files`) and creates a batch of
it (`/v1/batches`); a share of the batches is cancelled a few seconds after it was created. The gateway,
the control plane and the jobs process that runs batches may be dead at any moment, so every call is
retried until it is answered; a create whose answer was lost is retried with a new file of new
custom_ids, so that every custom_id of the run belongs to one batch at most, and whatever batch the lost
call created is found afterwards anyway (`bench.chaos.batch_files`).

Every line's body carries `user: <custom_id>`, which the gateway keeps with the execution's usage as the
client's label (`client_request_id`): it names the line an execution was billed for, whichever execution
the files report. It is a label only; the server-issued execution id is what is billed.
"""

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

CHAT = "/v1/chat/completions"
CALL_TIMEOUT_S = 30.0
RETRY_PAUSE_S = 0.5
CALL_DEADLINE_S = 120.0  # a call unanswered this long (every victim is back well before) stops the run
ID = re.compile(r"(file|batch)_[A-Za-z0-9]+")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


class BatchCallError(RuntimeError):
    """A Batch API call that got no usable answer within CALL_DEADLINE_S."""


@dataclass(frozen=True)
class BatchSettings:
    every_s: tuple[float, float]  # between one organization's batch submissions
    lines: tuple[int, int]  # lines per batch
    max_tokens: tuple[int, int]  # per line
    cancel_share: float  # the share of batches cancelled after creation
    cancel_after_s: tuple[float, float]  # how long after its creation


@dataclass
class SubmittedBatch:
    """One batch as its client created it; `batch_id` stays "" when the create call went unanswered."""

    organization_id: str
    tag: str  # the prefix of its custom_ids, unique in the run
    lines: int
    submitted_at_s: float
    batch_id: str = ""
    cancel: str = ""  # "" (not cancelled), or the cancel call's outcome: the batch's status, or "refused <status>"


@dataclass
class BatchTraffic:
    base_url: str  # the gateway's OpenAI-compatible API, ".../v1"
    api_keys: dict[str, str]  # organization id -> API key
    settings: BatchSettings
    seed: int
    submitted: list[SubmittedBatch] = field(default_factory=list)
    retried_calls: Counter = field(default_factory=Counter)  # "POST /files: ConnectError" -> times
    _started: float = 0.0

    async def run(self, running: Callable[[], bool]) -> None:
        """Submits batches while `running()` says the load goes on; returns once every cancel was sent."""
        self._started = time.monotonic()
        cancels: list[asyncio.Task] = []
        async with httpx.AsyncClient(base_url=self.base_url, timeout=CALL_TIMEOUT_S) as http:
            await asyncio.gather(
                *(
                    self._organization(http, index, organization_id, key, running, cancels)
                    for index, (organization_id, key) in enumerate(sorted(self.api_keys.items()))
                )
            )
            await asyncio.gather(*cancels)

    async def _organization(
        self,
        http: httpx.AsyncClient,
        index: int,
        organization_id: str,
        key: str,
        running: Callable[[], bool],
        cancels: list[asyncio.Task],
    ) -> None:
        rng = random.Random(f"{self.seed}-batches-{index}")
        count = 0
        while running():
            await asyncio.sleep(rng.uniform(*self.settings.every_s))
            if not running():
                return
            lines = rng.randint(*self.settings.lines)
            submitted = SubmittedBatch(organization_id, "", lines, time.monotonic() - self._started)
            self.submitted.append(submitted)
            while not submitted.batch_id:
                count += 1
                submitted.tag = f"o{index}b{count}"
                submitted.batch_id = await self._create(
                    http, key, _input_file(submitted.tag, lines, self.settings, rng)
                )
            if rng.random() < self.settings.cancel_share:
                delay = rng.uniform(*self.settings.cancel_after_s)
                cancels.append(asyncio.create_task(self._cancel_later(http, key, submitted, delay)))

    async def _create(self, http: httpx.AsyncClient, key: str, content: bytes) -> str:
        """Uploads the file and creates its batch: the batch id, or "" when the create went unanswered (it may
        have created the batch: `collect` finds it)."""
        uploaded = await self._call(
            http, "POST", "/files", key, files={"file": ("requests.jsonl", content)}, data={"purpose": "batch"}
        )
        body = {"input_file_id": uploaded["id"], "endpoint": CHAT, "completion_window": "24h"}
        try:
            response = await http.post("/batches", json=body, headers=bearer(key))
        except httpx.TransportError as error:
            self.retried_calls[f"POST /batches: {type(error).__name__}"] += 1
            return ""
        if response.status_code >= 500 or response.status_code == 429:
            self.retried_calls[f"POST /batches: {response.status_code}"] += 1
            await asyncio.sleep(RETRY_PAUSE_S)
            return ""
        if response.status_code != 200:
            raise BatchCallError(f"POST /batches answered {response.status_code}: {response.text[:500]}")
        return response.json()["id"]

    async def _cancel_later(self, http: httpx.AsyncClient, key: str, submitted: SubmittedBatch, delay: float) -> None:
        await asyncio.sleep(delay)
        path = f"/batches/{submitted.batch_id}/cancel"
        answer = await self._call(http, "POST", path, key, accept=(400,))
        if "status" in answer:
            submitted.cancel = answer["status"]
        else:  # it had ended already
            submitted.cancel = "refused: " + str(answer.get("error", {}).get("message", ""))[:80]

    async def _call(
        self, http: httpx.AsyncClient, method: str, path: str, key: str, accept: tuple[int, ...] = (), **kwargs
    ) -> dict:
        """Sends the call until it is answered with 200 (or a status in `accept`); the answer's JSON."""
        deadline = time.monotonic() + CALL_DEADLINE_S
        while True:
            try:
                response = await http.request(method, path, headers=bearer(key), **kwargs)
                if response.status_code == 200 or response.status_code in accept:
                    return response.json()
                if response.status_code < 500 and response.status_code != 429:
                    raise BatchCallError(f"{method} {path} answered {response.status_code}: {response.text[:500]}")
                reason = str(response.status_code)
            except httpx.TransportError as error:
                reason = type(error).__name__
            self.retried_calls[f"{method} {ID.sub('{id}', path)}: {reason}"] += 1
            if time.monotonic() > deadline:
                raise BatchCallError(f"{method} {path} unanswered for {CALL_DEADLINE_S:.0f} s; last: {reason}")
            await asyncio.sleep(RETRY_PAUSE_S)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _input_file(tag: str, lines: int, settings: BatchSettings, rng: random.Random) -> bytes:
    rows = []
    for number in range(lines):
        custom_id = f"{tag}-{number}"
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        body = {
            "model": "diptych-tiny",
            "messages": [{"role": "user", "content": f"{custom_id}: {words}"}],
            "max_tokens": rng.randint(*settings.max_tokens),
            "temperature": 0,
            "ignore_eos": True,
            "user": custom_id,
        }
        rows.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}))
    return "".join(row + "\n" for row in rows).encode()
