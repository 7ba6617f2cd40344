"""Plain `transformers` `generate` with static batches: the reference the platform is measured against.

Runs in the benchmark's own process on the same machine. A batch starts only when the previous one
has ended and holds up to `max_batch` of the requests that have arrived by then; it runs until its
longest answer is done. Each token is timestamped when its decoding step ends (a stopping criterion
sees every step), which credits `generate` with streaming it does not do.
"""

import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from typing_extensions import override

from bench.stats import RequestResult
from bench.workload import BenchRequest


class _StepClock(StoppingCriteria):
    """Records when each decoding step ended; never stops generation."""

    def __init__(self) -> None:
        self.times: list[float] = []

    @override
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        # StoppingCriteria declares the legacy torch.BoolTensor, which no tensor operation is typed to return.
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class StaticBatchGenerate:
    def __init__(self, model, pad_token_id: int) -> None:
        self._model = model
        self._pad = pad_token_id

    def greedy(self, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        """Batch-1 greedy generation, stopping at the end-of-sequence token: the correctness reference."""
        input_ids = torch.tensor([prompt_token_ids])
        with torch.inference_mode():
            output = self._model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self._pad,
            )
        return output[0, len(prompt_token_ids) :].tolist()

    def run_batch(self, requests: list[BenchRequest], sent_at: list[float]) -> list[RequestResult]:
        """One static batch, left-padded; end-of-sequence suppressed so every answer has its length."""
        width = max(len(r.prompt_token_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self._pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, request in enumerate(requests):
            length = len(request.prompt_token_ids)
            input_ids[row, width - length :] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - length :] = 1
        longest = max(r.output_tokens for r in requests)
        clock = _StepClock()
        with torch.inference_mode():
            output = self._model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=self._pad,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        return [
            RequestResult(
                sent_at=sent,
                token_times=clock.times[: request.output_tokens],
                token_ids=output[row, width : width + request.output_tokens].tolist(),
                prompt_tokens=len(request.prompt_token_ids),
                shares_prefix=request.shares_prefix,
            )
            for row, (request, sent) in enumerate(zip(requests, sent_at, strict=True))
        ]

    def replay_closed_loop(self, requests: list[BenchRequest], concurrency: int) -> list[RequestResult]:
        """Batches of `concurrency` in order, each request counted as sent when its batch starts."""
        results = []
        for first in range(0, len(requests), concurrency):
            batch = requests[first : first + concurrency]
            started = time.perf_counter()
            results += self.run_batch(batch, [started] * len(batch))
        return results

    def replay_open_loop(self, requests: list[BenchRequest], max_batch: int) -> list[RequestResult]:
        """Poisson arrivals in real time: each idle moment takes up to `max_batch` of the arrived requests."""
        start = time.perf_counter()
        pending = sorted(requests, key=lambda r: r.arrival_s)
        results = []
        while pending:
            now = time.perf_counter() - start
            if pending[0].arrival_s > now:
                time.sleep(pending[0].arrival_s - now)
                now = pending[0].arrival_s
            arrived = [r for r in pending if r.arrival_s <= now][:max_batch]
            pending = pending[len(arrived) :]
            results += self.run_batch(arrived, [start + r.arrival_s for r in arrived])
        return results
