"""One request's way through the gateway, below the protocol: authenticate, plan, admit under the rate
limits, run on workers, stream text, settle the limits and report usage. The gRPC service and the
OpenAI-compatible HTTP API both translate to and from this and nothing else.
"""

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from gateway.auth import Authenticator, Caller
from gateway.delivery import Delivery, decode_record
from gateway.idempotency import IdempotencyKeys
from gateway.limits import RateLimiter, Reservation
from gateway.metrics import INTER_TOKEN_LATENCY, OUTPUT_TOKENS, REQUESTS, TIME_TO_FIRST_TOKEN
from gateway.registry import Registry
from gateway.request_path import PhaseRecord, RequestPath, RequestTrace, finish_trace
from gateway.text import TextStream
from gateway.types import (
    ErrorKind,
    FinishReason,
    GatewayError,
    GenerationOutput,
    GenerationPlan,
    GenerationRequest,
    PhaseUsage,
    Usage,
)
from gateway.usage import UsageJournal
from gateway.validation import plan_generation

log = logging.getLogger(__name__)


@dataclass
class Admitted:
    """A request that passed authentication, validation and the rate limits; nothing ran yet."""

    caller: Caller
    plan: GenerationPlan
    reservation: Reservation
    arrived: float
    protocol: str
    replay: GenerationOutput | None = None  # a completed execution's stored whole answer

    @property
    def execution_id(self) -> str:
        return self.replay.request_id if self.replay is not None else self.plan.request_id

    @property
    def response_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the protocol tells the client before the first response: the execution, and a replay."""
        metadata = (("request-id", self.execution_id),)
        return metadata + ((("idempotent-replayed", "true"),) if self.replay is not None else ())


class Pipeline:
    def __init__(
        self,
        auth: Authenticator,
        registry: Registry,
        limiter: RateLimiter,
        path: RequestPath,
        journal: UsageJournal,
        idempotency: IdempotencyKeys,
    ) -> None:
        self.auth = auth
        self.registry = registry
        self._limiter = limiter
        self._path = path
        self._journal = journal
        self.idempotency = idempotency
        self.draining = False
        self.in_flight = 0

    async def admit(
        self, authorization: str | None, request: GenerationRequest, protocol: str, peer: str = ""
    ) -> Admitted:
        arrived = time.monotonic()
        try:
            if self.draining:
                raise GatewayError(ErrorKind.UNAVAILABLE, "this gateway is shutting down; retry on another")
            caller = await self.auth.authenticate_header(authorization, peer)
            plan = await plan_generation(request, self.registry, caller.organization_id)
            reservation = await self._limiter.admit(caller, len(plan.prompt_token_ids), plan.sampling.max_tokens)
            replay = await self._claim_idempotency_key(plan, request, reservation)
        except GatewayError as error:
            model = request.model if request.model in self.registry.models else ""  # no label per unknown name
            REQUESTS.labels(model, "", error.kind.value, protocol).inc()
            raise
        return Admitted(caller, plan, reservation, arrived, protocol, replay)

    async def _claim_idempotency_key(
        self, plan: GenerationPlan, request: GenerationRequest, reservation: Reservation
    ) -> GenerationOutput | None:
        if not plan.idempotency_key:
            return None
        lease_s = self._path.call_deadline(plan.sampling.max_tokens)
        try:
            replay = await self.idempotency.claim(
                plan.organization_id, plan.idempotency_key, request, plan.request_id, lease_s
            )
        except GatewayError:
            await self._settle(reservation, 0)
            raise
        if replay is not None:
            await self._settle(reservation, 0)
        return replay

    async def generate(self, admitted: Admitted) -> AsyncGenerator[GenerationOutput, None]:
        """Text deltas; the last one carries the finish reason and usage. Raises GatewayError.

        Each output is counted as delivered, durably, just before it is handed to the protocol."""
        if admitted.replay is not None:
            yield admitted.replay
            return
        plan, trace = admitted.plan, RequestTrace()
        delivery = Delivery(self._journal, plan, admitted.caller, trace)
        outcome = "CANCELLED"
        last_token_at = None
        final: GenerationOutput | None = None
        self.in_flight += 1
        try:
            text = TextStream(plan.tokenizer, plan.stop)
            async with aclosing(self._path.run(plan, trace)) as events:
                async for event in events:
                    now = time.monotonic()
                    if last_token_at is None:
                        ttft = TIME_TO_FIRST_TOKEN.labels(plan.model.name, trace.mode)
                        ttft.observe(now - admitted.arrived)
                    else:
                        INTER_TOKEN_LATENCY.labels(plan.model.name).observe(now - last_token_at)
                    last_token_at = now
                    delta = text.push(event.token_id)
                    last = text.stopped or event.finished
                    if last:
                        finish_trace(trace)
                        stopped = text.stopped or event.finished_by_eos
                        output = GenerationOutput(
                            plan.request_id,
                            delta + text.flush(),
                            [event.token_id],
                            FinishReason.STOP if stopped else FinishReason.LENGTH,
                            _usage(plan, trace, delivery.delivered + 1),
                        )
                    else:
                        output = GenerationOutput(plan.request_id, delta, [event.token_id])
                    delivery.counting(output)
                    if last:
                        final = output
                        await self._complete_idempotency_key(plan, delivery.whole(output))
                    yield output
                    if last:
                        outcome = "OK"
                        return
        except GatewayError as error:
            outcome = error.kind.value
            raise
        finally:
            self.in_flight -= 1
            finish_trace(trace)
            REQUESTS.labels(plan.model.name, trace.mode, outcome, admitted.protocol).inc()
            OUTPUT_TOKENS.labels(plan.model.name).inc(delivery.delivered)
            delivery.finish()
            if plan.idempotency_key and final is None:  # failed or cancelled: a retry runs anew
                self.idempotency.release(plan.organization_id, plan.idempotency_key, plan.request_id)
            await self._settle(admitted.reservation, delivery.delivered)

    async def _complete_idempotency_key(self, plan: GenerationPlan, whole: GenerationOutput) -> None:
        """Stored before the last response is handed over, so a retry sent by a client that has the answer
        finds it; the execution is complete and billed whether or not that last write succeeds."""
        if plan.idempotency_key:
            await self.idempotency.complete(plan.organization_id, plan.idempotency_key, plan.request_id, whole)

    async def _settle(self, reservation: Reservation, completion_tokens: int) -> None:
        try:
            await self._limiter.settle(reservation, completion_tokens)
        except Exception as error:  # a refund that failed only makes the limit stricter for a minute
            log.warning("could not refund unused output tokens: %r", error)


def _usage(plan: GenerationPlan, trace: RequestTrace, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=len(plan.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=trace.prefill.cached_tokens if trace.prefill else 0,
        prefill=_phase_usage(trace.prefill, len(plan.prompt_token_ids)),
        decode=_phase_usage(decode_record(trace), completion_tokens),
    )


def _phase_usage(record: PhaseRecord | None, tokens: int) -> PhaseUsage | None:
    if record is None:
        return None
    return PhaseUsage(
        tokens=tokens,
        cached_tokens=record.cached_tokens,
        kv_bytes=record.kv_bytes,
        compute_ms=record.compute_ms,
        worker_id=record.worker.id,
    )
