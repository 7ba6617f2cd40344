"""One request's way through the gateway, below the protocol: authenticate, plan, admit under the rate
limits, run on workers, stream text, settle the limits and report usage. The gRPC service and the
OpenAI-compatible HTTP API both translate to and from this and nothing else.
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, StatusCode

from diptych_common.logs import bind_request
from diptych_common.tracing import start_span, trace_id_of
from gateway.accounts.auth import Authenticator, Caller, check_allowed
from gateway.accounts.idempotency import IdempotencyKeys
from gateway.accounts.limits import RateLimited, RateLimiter, Reservation
from gateway.accounts.ratelimit_headers import Metadata, rate_limit_metadata
from gateway.accounts.usage import UsageJournal
from gateway.autoscale.signals import RECENT_LATENCIES
from gateway.core.choices import ChoiceRun, choice_plan, interleaved, request_usage, whole_answers
from gateway.core.delivery import Delivery, decode_record
from gateway.core.logprobs import token_logprob
from gateway.core.request_path import RequestPath
from gateway.core.text import TextStream
from gateway.core.trace import PhaseRecord, RequestTrace, finish_trace
from gateway.fleet.registry import Registry
from gateway.metrics import INTER_TOKEN_LATENCY, OUTPUT_TOKENS, PROMPT_TOKENS, TIME_TO_FIRST_TOKEN, count_request
from gateway.planning.tools import ToolCallStream
from gateway.planning.validation import plan_generation
from gateway.types import (
    ErrorKind,
    FinishReason,
    GatewayError,
    GenerationOutput,
    GenerationPlan,
    GenerationRequest,
    PhaseUsage,
    SampledToken,
    TokenLogprob,
    ToolCall,
    Usage,
)

log = logging.getLogger(__name__)

# Output tokens reserved per choice for a request without max_tokens; the rest is taken when it ends.
ESTIMATED_OUTPUT_TOKENS = 256


@dataclass
class Admitted:
    """A request that passed authentication, validation and the rate limits; nothing ran yet."""

    caller: Caller
    plan: GenerationPlan
    reservation: Reservation
    arrived: float
    protocol: str
    replay: list[GenerationOutput] | None = None  # a completed execution's stored whole answer, per choice
    span: Span = INVALID_SPAN  # the request's root span (gateway.request), ended when its stream ends
    # Set once `Pipeline.generate` began (it then frees what the request holds) or `Pipeline.abandon` ran.
    taken: bool = False

    @property
    def execution_id(self) -> str:
        return self.replay[0].request_id if self.replay is not None else self.plan.request_id

    @property
    def rate_limit_metadata(self) -> Metadata:
        return rate_limit_metadata(self.reservation.states)

    @property
    def response_metadata(self) -> Metadata:
        """What the protocol tells the client before the first response: the execution, a replay, and
        where the caller stands with its rate limits."""
        metadata: Metadata = (("request-id", self.execution_id),)
        metadata += (("idempotent-replayed", "true"),) if self.replay is not None else ()
        return metadata + self.rate_limit_metadata


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
        self._background: set[asyncio.Task[None]] = set()

    async def admit(
        self, authorization: str | None, request: GenerationRequest, protocol: str, peer: str = ""
    ) -> Admitted:
        arrived = time.monotonic()
        span = start_span("gateway.request", kind=SpanKind.SERVER, attributes={"protocol": protocol})
        try:
            if self.draining:
                raise GatewayError(ErrorKind.UNAVAILABLE, "this gateway is shutting down; retry on another")
            caller = await self.auth.identify(authorization, peer)
            reservation: Reservation | None = None
            try:
                check_allowed(caller, request)
                plan = await plan_generation(request, self.registry, caller.organization_id)
                reservation = await self._limiter.admit(
                    caller, len(plan.prompt_token_ids), reserved_output_tokens(plan, request)
                )
                replay = await self._claim_idempotency_key(caller, plan, request, reservation)
            except GatewayError as error:
                error.rate_limit_metadata = await self._rate_limit_metadata(caller, reservation, error)
                raise
        except GatewayError as error:
            model = request.model if request.model in self.registry.models else ""  # no label per unknown name
            count_request(model, "", error.kind.value, protocol)
            span.set_status(StatusCode.ERROR, error.message)
            span.end()
            raise
        except asyncio.CancelledError:  # the client went away while it was being admitted
            span.end()
            raise
        span.set_attributes({"request_id": plan.request_id, "model": plan.model.name, "n": plan.n})
        bind_request(plan.request_id, trace_id_of(span))
        return Admitted(caller, plan, reservation, arrived, protocol, replay, span)

    async def authenticate(self, authorization: str | None, peer: str = "") -> tuple[Caller, Metadata]:
        """The caller allowed to run inference, and its rate-limit state, for a call that takes nothing
        from the limits (listing models); a refusal after authentication carries the state too."""
        caller = await self.auth.identify(authorization, peer)
        metadata = await self._rate_limit_metadata(caller)
        try:
            check_allowed(caller)
        except GatewayError as error:
            error.rate_limit_metadata = metadata
            raise
        return caller, metadata

    async def _rate_limit_metadata(
        self, caller: Caller, reservation: Reservation | None = None, error: GatewayError | None = None
    ) -> Metadata:
        """The state after this request's take; when it was refused, the state that refused it; when it
        took nothing (refused before the limits), the state as it stands."""
        if isinstance(error, RateLimited):
            return rate_limit_metadata(error.states)
        if reservation is not None:
            return rate_limit_metadata(reservation.states)
        return rate_limit_metadata(await self._limiter.current(caller))

    async def _claim_idempotency_key(
        self, caller: Caller, plan: GenerationPlan, request: GenerationRequest, reservation: Reservation
    ) -> list[GenerationOutput] | None:
        if not plan.idempotency_key:
            if request.resume_request_id:
                await self._settle(reservation, 0)
                raise GatewayError(
                    ErrorKind.INVALID_ARGUMENT,
                    "resume_request_id replays what an execution stored under its idempotency key: send the "
                    "idempotency_key of the request it resumes",
                )
            return None
        lease_s = self._path.call_deadline(plan.sampling.max_tokens)
        try:
            replay = await self.idempotency.claim(caller, plan.idempotency_key, request, plan.request_id, lease_s)
        except GatewayError:
            await self._settle(reservation, 0)
            raise
        except asyncio.CancelledError:  # the client went away: the claim frees its key itself
            self._settle_soon(reservation, 0)
            raise
        if replay is not None:
            await self._settle(reservation, 0)
        return replay

    async def generate(self, admitted: Admitted, *, whole: bool = False) -> AsyncGenerator[GenerationOutput, None]:
        """Text deltas of every choice (`index`), interleaved as they come; each choice's last one carries
        its finish reason, and the very last one also the request's usage. Raises GatewayError.

        Each output is counted as delivered, durably, just before it is handed to the protocol; with
        `whole` (the protocol hands the answer over only once it is complete: a non-streaming HTTP
        answer), all of them once the last choice ended, before its answer is stored or handed over."""
        if admitted.taken:  # a defect of the protocol's: it ran it twice, or after abandoning it
            raise RuntimeError(f"request {admitted.plan.request_id} was already run or abandoned")
        admitted.taken = True
        if admitted.replay is not None:
            admitted.span.set_attribute("idempotent_replay", True)
            admitted.span.end()
            for output in admitted.replay:
                yield output
            return
        plan = admitted.plan
        runs = [self._choice_run(admitted, index, whole) for index in range(plan.n)]
        outcome = "CANCELLED"
        complete = False
        self.in_flight += 1
        try:
            async with aclosing(self._choice_outputs(admitted, runs)) as outputs:
                async for run, output in outputs:
                    run.delivery.counting(output)
                    if output.finish_reason is not None:
                        run.final = output
                        output = await self._last_of_choice(plan, runs, output)
                        complete = output.usage is not None
                    yield output
                    if complete:
                        outcome = "OK"
                        return
        except GatewayError as error:
            outcome = error.kind.value
            error.rate_limit_metadata = error.rate_limit_metadata or admitted.rate_limit_metadata
            admitted.span.set_status(StatusCode.ERROR, error.message)
            raise
        finally:
            self.in_flight -= 1
            delivered = 0
            for run in runs:
                finish_trace(run.trace)
                run.delivery.finish()
                delivered += run.delivery.delivered
            admitted.span.set_attributes({"outcome": outcome, "output_tokens": delivered})
            admitted.span.end()
            log.info(
                "%s %s request of %s ended %s: %d prompt and %d output tokens in %.3f s (%s)",
                admitted.protocol,
                runs[0].trace.mode or "unrouted",
                plan.model.name,
                outcome,
                len(plan.prompt_token_ids),
                delivered,
                time.monotonic() - admitted.arrived,
                admitted.caller.organization_id,
            )
            count_request(plan.model.name, runs[0].trace.mode, outcome, admitted.protocol)
            PROMPT_TOKENS.labels(plan.model.name).inc(len(plan.prompt_token_ids))
            OUTPUT_TOKENS.labels(plan.model.name).inc(delivered)
            if plan.idempotency_key and not complete:  # failed or cancelled: a retry runs anew
                self.idempotency.release(plan.organization_id, plan.idempotency_key, plan.request_id)
            await self._settle(admitted.reservation, delivered)

    def abandon(self, admitted: Admitted) -> None:
        """Frees what an admitted request holds when it will not run (its client went away before it did, or
        its protocol stopped early): the idempotency key and the reserved output tokens, in the background.
        Nothing once `generate` began, which frees them when it ends; safe to call more than once."""
        if admitted.taken:
            return
        admitted.taken = True
        admitted.span.end()
        if admitted.replay is not None:  # its key and limits were settled as it was admitted
            return
        plan = admitted.plan
        if plan.idempotency_key:
            self.idempotency.release(plan.organization_id, plan.idempotency_key, plan.request_id)
        self._settle_soon(admitted.reservation, 0)
        count_request(plan.model.name, "", "CANCELLED", admitted.protocol)

    def _choice_run(self, admitted: Admitted, index: int, whole: bool) -> ChoiceRun:
        plan, trace = choice_plan(admitted.plan, index), RequestTrace(span=admitted.span)
        delivery = Delivery(self._journal, plan, admitted.caller, trace, bills_prompt=index == 0, whole=whole)
        return ChoiceRun(index, plan, delivery, trace)

    def _choice_outputs(
        self, admitted: Admitted, runs: list[ChoiceRun]
    ) -> AsyncGenerator[tuple[ChoiceRun, GenerationOutput], None]:
        if len(runs) == 1:
            return self._choice(admitted, runs[0])
        return interleaved(runs, lambda run: self._choice(admitted, run))

    async def _choice(
        self, admitted: Admitted, run: ChoiceRun
    ) -> AsyncGenerator[tuple[ChoiceRun, GenerationOutput], None]:
        """One choice's outputs, each with its run, named by the request's execution id: one per arrival of
        tokens (the tokens that came together go out together); the last carries the choice's finish
        reason and usage. They count as delivered where the caller hands them over."""
        plan, trace = run.plan, run.trace
        request_id = admitted.plan.request_id
        first_token_at = last_token_at = 0.0
        produced = 0
        text = TextStream(plan.tokenizer, plan.stop)
        calls = ToolCallStream(plan.tools) if plan.tools else None
        inter_token_latency = INTER_TOKEN_LATENCY.labels(plan.model.name)
        async with aclosing(self._path.run(plan, trace)) as arrivals:
            async for tokens in arrivals:
                now = time.monotonic()
                if not produced:
                    first_token_at = last_token_at = now
                    if run.index == 0:
                        TIME_TO_FIRST_TOKEN.labels(plan.model.name, trace.mode).observe(now - admitted.arrived)
                        RECENT_LATENCIES.record_ttft(trace, now - admitted.arrived)
                deltas, ids = [], []
                for token in tokens:
                    if produced:  # the tokens that came with the first of them came no time after it
                        inter_token_latency.observe(now - last_token_at)
                        last_token_at = now
                    produced += 1
                    ids.append(token.token_id)
                    deltas.append(text.push(token.token_id))
                    if text.stopped or token.finished:
                        finish_trace(trace)
                        if produced > 1:  # the stream's mean time per output token after its first
                            RECENT_LATENCIES.record_tpot(trace, (now - first_token_at) / (produced - 1))
                        stopped = text.stopped or token.finished_by_eos
                        last = "".join(deltas) + text.flush()
                        content, tool_calls = calls.end(last, cut=not stopped) if calls else (last, ())
                        yield (
                            run,
                            GenerationOutput(
                                request_id,
                                content,
                                ids,
                                _finish_reason(plan, stopped, tool_calls),
                                _usage(plan, trace, produced),
                                index=run.index,
                                logprobs=_logprobs(plan, tokens[: len(ids)]),
                                tool_calls=tool_calls,
                            ),
                        )
                        return
                delta = deltas[0] if len(deltas) == 1 else "".join(deltas)
                if calls is not None:  # text that may still be a tool call is held back
                    delta = calls.push(delta)
                yield run, GenerationOutput(request_id, delta, ids, index=run.index, logprobs=_logprobs(plan, tokens))

    async def _last_of_choice(
        self, plan: GenerationPlan, runs: list[ChoiceRun], output: GenerationOutput
    ) -> GenerationOutput:
        """A choice's last output as the client gets it: the request's usage on the last choice to end
        (none on the others); the whole answer is stored under the idempotency key before it goes out."""
        if any(run.final is None for run in runs):
            return dataclasses.replace(output, usage=None)
        for run in runs:
            run.delivery.hand_over_whole()
        usage = request_usage(runs)
        if plan.idempotency_key:
            await self._complete_idempotency_key(plan, whole_answers(runs, usage))
        return dataclasses.replace(output, usage=usage)

    async def _complete_idempotency_key(self, plan: GenerationPlan, wholes: list[GenerationOutput]) -> None:
        """Stored before the last response is handed over, so a retry sent by a client that has the answer
        finds it; the execution is complete and billed whether or not that last write succeeds."""
        await self.idempotency.complete(plan.organization_id, plan.idempotency_key, plan.request_id, wholes)

    def _settle_soon(self, reservation: Reservation, completion_tokens: int) -> None:
        """`_settle` in the background, for a caller that cannot wait (cancelled, or not a coroutine)."""
        task = asyncio.get_running_loop().create_task(self._settle(reservation, completion_tokens))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _settle(self, reservation: Reservation, completion_tokens: int) -> None:
        try:
            await self._limiter.settle(reservation, completion_tokens)
        except Exception as error:  # a refund that failed only makes the limit stricter for a minute
            log.warning("could not refund unused output tokens: %r", error)


def reserved_output_tokens(plan: GenerationPlan, request: GenerationRequest) -> int:
    """The output tokens the rate limiter takes up front, for every choice: max_tokens where the client set
    it; where it did not (a chat may then run to the end of the context) a bounded estimate, settled against
    the real count when the request ends."""
    per_choice = plan.sampling.max_tokens
    if request.max_tokens is None:
        per_choice = min(per_choice, ESTIMATED_OUTPUT_TOKENS)
    return per_choice * plan.n


def _finish_reason(plan: GenerationPlan, stopped: bool, tool_calls: tuple[ToolCall, ...]) -> FinishReason:
    """`tool_calls` when the model chose to call; calls of a function tool_choice named end as "stop", as
    OpenAI's do."""
    if tool_calls and not plan.tool_named:
        return FinishReason.TOOL_CALLS
    return FinishReason.STOP if stopped else FinishReason.LENGTH


def _logprobs(plan: GenerationPlan, tokens: list[SampledToken]) -> list[TokenLogprob] | None:
    if tokens[0].logprobs is None:  # the request did not ask for them
        return None
    return [token_logprob(plan.tokenizer, token.token_id, token.logprobs) for token in tokens if token.logprobs]


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
