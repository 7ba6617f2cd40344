"""Decode engine: continuous batching. Sequences join the running batch at the next step and leave
as soon as they finish or are aborted; each step feeds one token per sequence."""

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from workers.kv_cache import DecodeBatch, SequenceKV
from workers.model_runner import ModelRunner
from workers.sampling import SamplingParams, StopCriteria, sample


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    finished: bool
    finished_by_eos: bool


@dataclass
class DecodeSequence:
    request_id: str
    prompt_length: int
    output_token_ids: list[int]
    sampling: SamplingParams
    kv: SequenceKV | None  # set while the sequence waits to join the batch
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    compute_ms: float = 0.0
    leaving: bool = False  # finished or aborted: leaves the batch before the next step


class DecodeEngine:
    def __init__(
        self,
        runner: ModelRunner,
        executor: Executor,
        stop: StopCriteria,
        max_running: int = 64,
    ) -> None:
        self._runner = runner
        self._executor = executor
        self._stop = stop
        self._max_running = max_running
        self._batch = DecodeBatch(runner.config)
        self._running: dict[str, DecodeSequence] = {}
        self._waiting: dict[str, DecodeSequence] = {}
        self._wakeup = asyncio.Event()
        self.tokens_generated = 0

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_sequences(self) -> int:
        return len(self._running)

    @property
    def kv_tokens_held(self) -> int:
        """Tokens of KV this engine holds, in the batch and waiting to join it."""
        waiting = sum(seq.kv.length for seq in self._waiting.values() if seq.kv is not None)
        return sum(self._batch.lengths) + waiting

    def add(
        self, request_id: str, prompt_length: int, first_token_id: int, kv: SequenceKV, sampling: SamplingParams
    ) -> DecodeSequence:
        """Queues a prefilled sequence whose first token is already sampled; its tokens after the first
        arrive on the returned sequence's `outputs` queue."""
        if request_id in self._running or request_id in self._waiting:
            raise ValueError(f"request {request_id} is already decoding here")
        seq = DecodeSequence(request_id, prompt_length, [first_token_id], sampling, kv)
        self._waiting[request_id] = seq
        self._wakeup.set()
        return seq

    def abort(self, request_id: str) -> None:
        """Stops a sequence; its KV is released before the next step."""
        seq = self._waiting.pop(request_id, None) or self._running.get(request_id)
        if seq is not None:
            seq.leaving = True
            seq.kv = None
            self._wakeup.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._update_batch()
            if not self._running:
                self._wakeup.clear()
                continue
            sequences = [self._running[request_id] for request_id in self._batch.request_ids]
            inputs = [seq.output_token_ids[-1] for seq in sequences]
            started = time.monotonic()
            logits = await loop.run_in_executor(self._executor, self._runner.decode_step, self._batch, inputs)
            tokens = sample(
                logits, [seq.sampling for seq in sequences], [len(seq.output_token_ids) for seq in sequences]
            )
            share_ms = (time.monotonic() - started) * 1000 / len(sequences)
            for seq, token in zip(sequences, tokens):
                seq.compute_ms += share_ms
                if not seq.leaving:
                    self._emit(seq, token)

    def _emit(self, seq: DecodeSequence, token_id: int) -> None:
        seq.output_token_ids.append(token_id)
        self.tokens_generated += 1
        finished, by_eos = self._stop.check(token_id, len(seq.output_token_ids), seq.prompt_length, seq.sampling)
        seq.outputs.put_nowait(TokenOutput(token_id, finished, by_eos))
        if finished:
            seq.leaving = True

    def _update_batch(self) -> None:
        """Drops finished and aborted sequences, admits waiting ones, and repacks when that changed
        the membership."""
        leaving = [request_id for request_id, seq in self._running.items() if seq.leaving]
        joining = []
        while self._waiting and len(self._running) - len(leaving) + len(joining) < self._max_running:
            joining.append(self._waiting.pop(next(iter(self._waiting))))
        if not leaving and not joining:
            return
        for request_id in leaving:
            del self._running[request_id]
        members = [(request_id, self._batch.extract(request_id)) for request_id in self._batch.request_ids
                   if request_id in self._running]
        for seq in joining:
            self._running[seq.request_id] = seq
            members.append((seq.request_id, seq.kv))
            seq.kv = None
        self._batch.rebuild(members)
