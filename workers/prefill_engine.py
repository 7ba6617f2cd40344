"""Prefill engine: batches waiting prompts under a token budget, runs them in one forward pass and
samples each prompt's first token."""

import asyncio
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass

from workers.kv_cache import SequenceKV
from workers.model_runner import ModelRunner
from workers.sampling import SamplingParams, sample


@dataclass
class PrefillResult:
    first_token_id: int
    kv: SequenceKV
    compute_ms: int


@dataclass
class _PrefillJob:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


class PrefillEngine:
    def __init__(self, runner: ModelRunner, executor: Executor, token_budget: int = 4096) -> None:
        self._runner = runner
        self._executor = executor
        self._token_budget = token_budget
        self._waiting: deque[_PrefillJob] = deque()
        self._wakeup = asyncio.Event()
        self.prompt_tokens_processed = 0
        self.batches_run = 0

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams) -> asyncio.Future:
        """Queues a prompt; the future resolves to its PrefillResult. Cancelling the future drops the
        prompt if it has not run yet."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_PrefillJob(prompt_token_ids, sampling, future))
        self._wakeup.set()
        return future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            batch = self._next_batch()
            if not batch:
                self._wakeup.clear()
                continue
            started = time.monotonic()
            self.batches_run += 1
            try:
                logits, kvs = await loop.run_in_executor(
                    self._executor, self._runner.prefill, [job.prompt_token_ids for job in batch]
                )
                first_tokens = sample(logits, [job.sampling for job in batch], [0] * len(batch))
            except Exception as error:  # a failed forward pass fails its batch, not the engine
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            compute_ms = round((time.monotonic() - started) * 1000)
            for job, token, kv in zip(batch, first_tokens, kvs):
                self.prompt_tokens_processed += len(job.prompt_token_ids)
                if not job.future.done():
                    job.future.set_result(PrefillResult(token, kv, compute_ms))

    def _next_batch(self) -> list[_PrefillJob]:
        """Takes waiting prompts in arrival order while their padded size fits the token budget;
        the first prompt always goes, whatever its length."""
        batch: list[_PrefillJob] = []
        longest = 0
        while self._waiting:
            job = self._waiting[0]
            if job.future.cancelled():
                self._waiting.popleft()
                continue
            longest_if_added = max(longest, len(job.prompt_token_ids))
            if batch and longest_if_added * (len(batch) + 1) > self._token_budget:
                break
            batch.append(self._waiting.popleft())
            longest = longest_if_added
        return batch
