"""The public Inference service: authenticate, plan, route, stream text, report usage."""

import logging
import time
from contextlib import aclosing

import grpc

from diptych._proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.auth import Authenticator, Caller
from gateway.errors import GatewayError
from gateway.metrics import OUTPUT_TOKENS, REQUESTS, TIME_TO_FIRST_TOKEN
from gateway.registry import Registry
from gateway.request_path import PhaseRecord, RequestPath, RequestTrace
from gateway.routing import Router
from gateway.text import TextStream
from gateway.tokenization import tokenizer_for
from gateway.usage import UsageReporter
from gateway.validation import GenerationPlan, plan_generation

log = logging.getLogger(__name__)

FinishReason = inference_pb2.FinishReason


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self, auth: Authenticator, registry: Registry, router: Router, path: RequestPath, usage: UsageReporter
    ) -> None:
        self._auth = auth
        self._registry = registry
        self._router = router
        self._path = path
        self._usage = usage

    async def Generate(self, request, context):
        arrived = time.monotonic()
        try:
            caller = await self._auth.authenticate(context.invocation_metadata())
            plan = plan_generation(request, self._registry)
            route = self._router.route(plan.model.name)
        except GatewayError as error:
            REQUESTS.labels(request.model, "", error.code.name).inc()
            await _abort(context, error, request.request_id)
        mode = "colocated" if route.colocated else "split"
        trace = RequestTrace()
        completion_tokens = 0
        outcome = "CANCELLED"
        self._router.acquire(route)
        try:
            text = TextStream(plan.tokenizer, plan.stop)
            async with aclosing(self._path.run(plan, route, trace)) as events:
                async for event in events:
                    if completion_tokens == 0:
                        TIME_TO_FIRST_TOKEN.labels(plan.model.name, mode).observe(time.monotonic() - arrived)
                    completion_tokens += 1
                    delta = text.push(event.token_id)
                    if text.stopped or event.finished:
                        outcome = "OK"
                        yield inference_pb2.GenerateResponse(
                            request_id=plan.request_id, text=delta + text.flush(), token_ids=[event.token_id],
                            finish_reason=_finish_reason(text.stopped or event.finished_by_eos),
                            usage=_usage(plan, trace, completion_tokens),
                        )
                        return
                    yield inference_pb2.GenerateResponse(request_id=plan.request_id, text=delta, token_ids=[event.token_id])
        except GatewayError as error:
            outcome = error.code.name
            await _abort(context, error, plan.request_id)
        finally:
            self._router.release(route)
            REQUESTS.labels(plan.model.name, mode, outcome).inc()
            OUTPUT_TOKENS.labels(plan.model.name).inc(completion_tokens)
            self._usage.record(_usage_events(plan, caller, trace, completion_tokens))

    async def ListModels(self, request, context):
        try:
            await self._auth.authenticate(context.invocation_metadata())
        except GatewayError as error:
            await _abort(context, error, "")
        return inference_pb2.ListModelsResponse(models=[
            inference_pb2.Model(
                id=model.name, context_length=model.context_length,
                has_chat_template=bool(tokenizer_for(model.source).chat_template),
            )
            for model in self._registry.models.values()
        ])


async def _abort(context, error: GatewayError, request_id: str) -> None:
    if request_id:
        context.set_trailing_metadata((("request-id", request_id),))
    await context.abort(error.code, error.message)


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


def _usage_events(plan: GenerationPlan, caller: Caller, trace: RequestTrace, completion_tokens: int) -> list[dict]:
    """The prefill event bills the prompt; the decode event bills every output token, the first one
    (sampled by prefill) included. Nothing is billed when no token was produced."""
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
            "finished_at": record.finished_at.isoformat(),
        }
        for phase, record, tokens in phases
    ]
