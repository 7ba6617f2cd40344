"""One request's way through the gateway, below the protocol: authenticate, plan, admit under the rate
limits, run on workers, stream text, settle the limits and report usage. The gRPC service and the
OpenAI-compatible HTTP API both translate to and from this and nothing else.
"""

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from diptych._proto.v1 import inference_pb2
from gateway.auth import Authenticator, Caller
from gateway.errors import GatewayError
from gateway.limits import RateLimiter, Reservation
from gateway.metrics import INTER_TOKEN_LATENCY, OUTPUT_TOKENS, REQUESTS, TIME_TO_FIRST_TOKEN
from gateway.registry import Registry
from gateway.request_path import PhaseRecord, RequestPath, RequestTrace, finish_trace
from gateway.text import TextStream
from gateway.usage import UsageReporter
from gateway.validation import GenerationPlan, plan_generation

log = logging.getLogger(__name__)

FinishReason = inference_pb2.FinishReason


@dataclass
class Admitted:
    """A request that passed authentication, validation and the rate limits; nothing ran yet."""
    caller: Caller
    plan: GenerationPlan
    reservation: Reservation
    arrived: float
    protocol: str


class Pipeline:
    def __init__(
        self, auth: Authenticator, registry: Registry, limiter: RateLimiter, path: RequestPath, usage: UsageReporter
    ) -> None:
        self.auth = auth
        self.registry = registry
        self._limiter = limiter
        self._path = path
        self._usage = usage
        self.draining = False
        self.in_flight = 0

    async def admit(self, authorization: str | None, request: inference_pb2.GenerateRequest, protocol: str) -> Admitted:
        arrived = time.monotonic()
        try:
            if self.draining:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "this gateway is shutting down; retry on another")
            caller = await self.auth.authenticate_header(authorization)
            plan = plan_generation(request, self.registry, caller.organization_id)
            reservation = await self._limiter.admit(caller, len(plan.prompt_token_ids), plan.sampling.max_tokens)
        except GatewayError as error:
            REQUESTS.labels(request.model, "", error.code.name, protocol).inc()
            raise
        return Admitted(caller, plan, reservation, arrived, protocol)

    async def generate(self, admitted: Admitted) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Text deltas; the last one carries the finish reason and usage. Raises GatewayError."""
        plan, trace = admitted.plan, RequestTrace()
        completion_tokens = 0
        outcome = "CANCELLED"
        last_token_at = None
        self.in_flight += 1
        try:
            text = TextStream(plan.tokenizer, plan.stop)
            async with aclosing(self._path.run(plan, trace)) as events:
                async for event in events:
                    now = time.monotonic()
                    if last_token_at is None:
                        TIME_TO_FIRST_TOKEN.labels(plan.model.name, trace.decision.value).observe(now - admitted.arrived)
                    else:
                        INTER_TOKEN_LATENCY.labels(plan.model.name).observe(now - last_token_at)
                    last_token_at = now
                    completion_tokens += 1
                    delta = text.push(event.token_id)
                    if text.stopped or event.finished:
                        outcome = "OK"
                        finish_trace(trace)
                        yield inference_pb2.GenerateResponse(
                            request_id=plan.request_id, text=delta + text.flush(), token_ids=[event.token_id],
                            finish_reason=_finish_reason(text.stopped or event.finished_by_eos),
                            usage=_usage(plan, trace, completion_tokens),
                        )
                        return
                    yield inference_pb2.GenerateResponse(request_id=plan.request_id, text=delta, token_ids=[event.token_id])
        except GatewayError as error:
            outcome = error.code.name
            raise
        finally:
            self.in_flight -= 1
            finish_trace(trace)
            mode = trace.decision.value if trace.decision else ""
            REQUESTS.labels(plan.model.name, mode, outcome, admitted.protocol).inc()
            OUTPUT_TOKENS.labels(plan.model.name).inc(completion_tokens)
            self._usage.record(usage_events(plan, admitted.caller, trace, completion_tokens))
            await self._settle(admitted.reservation, completion_tokens)

    async def _settle(self, reservation: Reservation, completion_tokens: int) -> None:
        try:
            await self._limiter.settle(reservation, completion_tokens)
        except Exception as error:   # a refund that failed only makes the limit stricter for a minute
            log.warning("could not refund unused output tokens: %r", error)


def _finish_reason(stopped: bool) -> int:
    return FinishReason.FINISH_REASON_STOP if stopped else FinishReason.FINISH_REASON_LENGTH


def _usage(plan: GenerationPlan, trace: RequestTrace, completion_tokens: int) -> inference_pb2.Usage:
    return inference_pb2.Usage(
        prompt_tokens=len(plan.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=trace.prefill.cached_tokens if trace.prefill else 0,
        prefill=_phase_usage(trace.prefill, len(plan.prompt_token_ids)),
        decode=_phase_usage(_decode_record(trace), completion_tokens),
    )


def _phase_usage(record: PhaseRecord | None, tokens: int) -> inference_pb2.PhaseUsage | None:
    if record is None:
        return None
    return inference_pb2.PhaseUsage(
        tokens=tokens, cached_tokens=record.cached_tokens, kv_bytes=record.kv_bytes,
        compute_ms=record.compute_ms, worker_id=record.worker.id,
    )


def _decode_record(trace: RequestTrace) -> PhaseRecord | None:
    """The decode phase; when the first token ended the request, the prefill worker that sampled it."""
    if trace.decode is not None or trace.prefill is None:
        return trace.decode
    return PhaseRecord(trace.prefill.worker, started_at=trace.prefill.finished_at, finished_at=trace.prefill.finished_at)


def usage_events(plan: GenerationPlan, caller: Caller, trace: RequestTrace, completion_tokens: int) -> list[dict]:
    """The prefill event bills the prompt; the decode event bills every output token, the first one
    (sampled by prefill) included. Nothing is billed when no token was produced. A prefill re-run after a
    worker failure is not billed again."""
    if trace.prefill is None or completion_tokens == 0:
        return []
    phases = (
        ("prefill", trace.prefill, len(plan.prompt_token_ids)),
        ("decode", _decode_record(trace), completion_tokens),
    )
    return [
        {
            "request_id": plan.request_id,
            "phase": phase,
            "organization_id": caller.organization_id,
            "api_key_id": caller.api_key_id,
            "model": plan.model.name,
            "region": record.worker.region,
            "worker_id": record.worker.id,
            "tokens": tokens,
            "cached_tokens": record.cached_tokens if phase == "prefill" else 0,
            "kv_bytes": record.kv_bytes,
            "compute_ms": record.compute_ms,
            "started_at": record.started_at.isoformat(),
            "finished_at": (record.finished_at or record.started_at).isoformat(),
        }
        for phase, record, tokens in phases
    ]
