"""The choices of one request (n >= 1): each its own sequence on the same prompt, run so that the prompt's
KV cache is computed once.

Choice 0 runs first. Once its prompt's KV cache is where a sibling finds it (`RequestTrace.prompt_shared`:
after its first token on a colocated worker; after its first decode token in split mode, when the decode
worker has admitted the handed-off blocks), choices 1..n-1 start, pinned to the same workers
(`routing.Pin`). Their prompts then hit the prefix caches: the prefill worker computes only the prompt's
last, partial block (a block is named only when full, and the last token is always computed), and the
decode worker already holds every full block, so only the rest moves.

Each choice is its own execution in the usage ledger (`<execution id>-c<i>` for i >= 1), billed for its
output as decode. The prompt is billed once, as OpenAI does, by choice 0's prefill event (the cached part at
the cached rate): the other choices' prefills reuse it from the prefix caches and are not billed, so the
response's `prompt_tokens`, the ledger, the usage API, the dashboard and the invoice all count it once.
"""

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass

from gateway.core.delivery import Delivery
from gateway.core.trace import RequestTrace
from gateway.types import GenerationOutput, GenerationPlan, PhaseUsage, Usage

UINT64_MASK = 2**64 - 1


@dataclass
class ChoiceRun:
    """One choice as it runs: its own plan (id and seed), trace and delivery count."""

    index: int
    plan: GenerationPlan
    delivery: Delivery
    trace: RequestTrace
    final: GenerationOutput | None = None


def choice_plan(plan: GenerationPlan, index: int) -> GenerationPlan:
    """Choice `index`'s plan: choice 0 is the request's own; choice i >= 1 has its own execution id and,
    with a seed, its own seed derived from the request's, so that choices differ and replay exactly."""
    if index == 0:
        return plan
    sampling = plan.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=choice_seed(sampling.seed, index))
    return dataclasses.replace(plan, request_id=f"{plan.request_id}-c{index}", sampling=sampling)


def choice_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.sha256(f"diptych-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & UINT64_MASK


class _Ended:
    """What a choice's pump puts last on `interleaved`'s queue."""


async def interleaved(
    runs: list[ChoiceRun], stream: Callable[[ChoiceRun], AsyncGenerator[tuple[ChoiceRun, GenerationOutput], None]]
) -> AsyncGenerator[tuple[ChoiceRun, GenerationOutput], None]:
    """Every choice's outputs as they come (`stream` yields each choice's with its run); choices 1..n-1
    start once choice 0 shares its prompt. Raises the first choice's error; closing it cancels every
    choice."""
    queue: asyncio.Queue[tuple[ChoiceRun, GenerationOutput | Exception | _Ended]] = asyncio.Queue()
    ended = _Ended()

    async def pump(run: ChoiceRun) -> None:
        try:
            async with aclosing(stream(run)) as outputs:
                async for pair in outputs:
                    queue.put_nowait(pair)
        except Exception as error:
            queue.put_nowait((run, error))
        finally:
            queue.put_nowait((run, ended))

    first = asyncio.create_task(pump(runs[0]))
    tasks = [first]

    async def start_the_rest() -> None:
        shared = asyncio.create_task(runs[0].trace.prompt_shared.wait())
        try:
            await asyncio.wait({shared, first}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            shared.cancel()
        pin = runs[0].trace.pin_here()
        for run in runs[1:]:
            run.trace.pin = pin
            tasks.append(asyncio.create_task(pump(run)))

    starter = asyncio.create_task(start_the_rest())
    try:
        running = len(runs)
        while running:
            run, item = await queue.get()
            if isinstance(item, _Ended):
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield run, item
    finally:
        starter.cancel()
        with suppress(asyncio.CancelledError):
            await starter
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def request_usage(runs: list[ChoiceRun]) -> Usage:
    """The whole request's usage: the prompt counted once, the choices' outputs summed; the phases as billed:
    prefill choice 0's (the prompt, billed once), decode summed over every choice, named by choice 0's
    workers."""
    usages = [run.final.usage for run in runs if run.final is not None and run.final.usage is not None]
    head = usages[0]
    return Usage(
        prompt_tokens=head.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=head.cached_tokens,
        prefill=head.prefill,
        decode=_summed([u.decode for u in usages]),
    )


def whole_answers(runs: list[ChoiceRun], usage: Usage) -> list[GenerationOutput]:
    """Every choice's whole answer, as an idempotency key stores them: the request's usage on the last."""
    wholes = [
        dataclasses.replace(run.delivery.whole(run.final), usage=None, index=run.index)
        for run in runs
        if run.final is not None
    ]
    wholes[-1] = dataclasses.replace(wholes[-1], usage=usage)
    return wholes


def _summed(phases: list[PhaseUsage | None]) -> PhaseUsage | None:
    present = [p for p in phases if p is not None]
    if not present:
        return None
    return PhaseUsage(
        tokens=sum(p.tokens for p in present),
        cached_tokens=sum(p.cached_tokens for p in present),
        kv_bytes=sum(p.kv_bytes for p in present),
        compute_ms=sum(p.compute_ms for p in present),
        worker_id=present[0].worker_id,
    )
