"""What one execution delivered to its client, counted durably, and the usage events that bill it.

What is billed: the prompt once (prefill), when at least one output token was delivered; and every output
token delivered (decode), the first one included although prefill sampled it. The prompt is billed once per
request: the choices after the first of an n > 1 request run on the same prompt from the prefix cache and
bill only their output. A token is delivered when
the gateway hands its response to the client's connection; the journal counts it durably just before.
So a stream the client cancels is billed for the responses handed to its connection before the cancel
arrived (the last of them may still have been in flight, unread); a stream cut by the death of the
gateway for those its journal counted: the one being handed over, and those gRPC's client library had
received but its caller not yet read (it drops them when the connection breaks). With an idempotency key,
all of them stay the client's to fetch: the gateway's next run stores them as the key's answer. Tokens
computed but never handed over (a worker's steps beyond a cancel or a stop string, a stream that failed before its first
token) are not billed.
"""

from diptych_common.internal_api.messages import UsageEvent
from diptych_common.tracing import traceparent_of
from gateway.accounts.auth import Caller
from gateway.accounts.idempotency import stored_logprobs
from gateway.accounts.usage import UsageJournal, with_delivered
from gateway.core.trace import PhaseRecord, RequestTrace
from gateway.types import GenerationOutput, GenerationPlan, TokenLogprob


class Delivery:
    def __init__(
        self,
        journal: UsageJournal,
        plan: GenerationPlan,
        caller: Caller,
        trace: RequestTrace,
        bills_prompt: bool,
        whole: bool = False,
    ) -> None:
        self._journal = journal
        self._bills_prompt = bills_prompt
        self._plan = plan
        self._caller = caller
        self._trace = trace
        self._in_one_piece = whole  # the answer is handed over in one piece, once complete (`hand_over_whole`)
        # a streamed answer of one choice, under an idempotency key: what a resume can fetch
        self._keeps_outputs = bool(plan.idempotency_key) and plan.n == 1 and not whole
        self._produced = 0
        self.delivered = 0
        self._workers: tuple[str, ...] = ()  # the workers the journal's events name
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None  # when the request asked for them

    def counting(self, output: GenerationOutput) -> None:
        """The output is about to be handed to the protocol: it counts from now on (for an answer handed
        over whole, from `hand_over_whole`)."""
        self._produced += len(output.token_ids)
        if self._keeps_outputs:
            logprobs = None if output.logprobs is None else stored_logprobs(output.logprobs)
            self._journal.keep_output(self._plan.request_id, output.text, output.token_ids, logprobs)
        if not self._in_one_piece:
            self._count_delivered()
        if self._plan.idempotency_key:
            self._text.append(output.text)
            self._token_ids.extend(output.token_ids)
            if output.logprobs is not None:
                self._logprobs = (self._logprobs or []) + output.logprobs

    def hand_over_whole(self) -> None:
        """Every choice of an answer handed over whole ended: all its outputs count from now on. Until
        then a gateway that dies, or a client that leaves, bills nothing of it: nothing was handed over."""
        if self._in_one_piece and self._produced:
            self._count_delivered()

    def _count_delivered(self) -> None:
        self.delivered = self._produced
        workers = self._workers_on_record()
        if workers != self._workers:
            self._journal.track(self._plan.request_id, self._events(), self.delivered)
            self._workers = workers
        else:
            self._journal.count_delivered(self._plan.request_id, self.delivered)

    def finish(self) -> None:
        """The stream ended: its events, final compute times and KV bytes included, go to the outbox."""
        if self._workers or self.delivered:
            events = with_delivered(self._events(), self.delivered)
            self._journal.finish(self._plan.request_id, events, traceparent_of(self._trace.span))

    def whole(self, final: GenerationOutput) -> GenerationOutput:
        """The execution's whole answer in one output, as an idempotency key stores it for a retry."""
        return GenerationOutput(
            final.request_id,
            "".join(self._text),
            list(self._token_ids),
            final.finish_reason,
            final.usage,
            tool_calls=final.tool_calls,
            logprobs=self._logprobs,
        )

    def _workers_on_record(self) -> tuple[str, ...]:
        """The workers of the phases `decode_record` bills: checked before every output, so built plainly."""
        prefill, decode = self._trace.prefill, self._trace.decode
        if prefill is None:
            return () if decode is None else (decode.worker.id,)
        return prefill.worker.id, (decode or prefill).worker.id

    def _events(self) -> list[UsageEvent]:
        return usage_events(self._plan, self._caller, self._trace, max(self.delivered, 1), self._bills_prompt)


def decode_record(trace: RequestTrace) -> PhaseRecord | None:
    """The decode phase; when the first token ended the request, the prefill worker that sampled it."""
    if trace.prefill is None:
        return trace.decode
    return _billed_decode(trace.prefill, trace.decode)


def _billed_decode(prefill: PhaseRecord, decode: PhaseRecord | None) -> PhaseRecord:
    if decode is not None:
        return decode
    finished_at = prefill.finished_at or prefill.started_at  # a prefill is recorded once finished
    return PhaseRecord(prefill.worker, started_at=finished_at, finished_at=finished_at)


def usage_events(
    plan: GenerationPlan, caller: Caller, trace: RequestTrace, completion_tokens: int, bills_prompt: bool = True
) -> list[UsageEvent]:
    """The prefill event bills the prompt (only where `bills_prompt`: a request's first choice), the decode
    event the output tokens. A prefill re-run after a worker failure is not billed again."""
    prefill = trace.prefill
    if prefill is None or completion_tokens == 0:
        return []
    decode = ("decode", _billed_decode(prefill, trace.decode), completion_tokens)
    phases = (("prefill", prefill, len(plan.prompt_token_ids)), decode) if bills_prompt else (decode,)
    return [
        UsageEvent(
            request_id=plan.request_id,
            client_request_id=plan.client_request_id,
            phase=phase,
            organization_id=caller.organization_id,
            api_key_id=caller.api_key_id,
            model=plan.model.name,
            region=record.worker.region,
            worker_id=record.worker.id,
            tokens=tokens,
            cached_tokens=record.cached_tokens if phase == "prefill" else 0,
            kv_bytes=record.kv_bytes,
            compute_ms=record.compute_ms,
            started_at=record.started_at.isoformat(),
            finished_at=(record.finished_at or record.started_at).isoformat(),
            tier=caller.kind,
        )
        for phase, record, tokens in phases
    ]
