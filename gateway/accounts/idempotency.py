"""Idempotency keys, with Stripe's semantics, kept by the control plane so that every gateway agrees.

A key belongs to one organization and names one request of one API key: another key of the organization
that sends it is refused (INVALID_ARGUMENT) and learns nothing of the first request. The first request with
a key claims it and runs as a new execution. While it runs, another request with the key is refused
(ABORTED: retry later). Once it completed, a request with the key and the same parameters gets the stored
final response back (nothing runs, nothing is billed again: the first execution was); with other parameters
it is refused (INVALID_ARGUMENT). An execution that failed or was cancelled releases the key, so a retry
runs anew and is billed as the new execution it is; so does one whose answer could not be stored (larger
than MAX_STORED_ANSWER_BYTES, or the control plane did not take it), as nothing could answer a retry.

The gateway's journal records every key it claims until the answer is stored or the key freed: a gateway
killed while holding keys frees them when it starts again on the same state directory; one that never comes
back holds them until their lease ends. While the control plane cannot be reached, the gateway claims,
stores and frees keys alone and hands them over once it can (outage_claims.py).
"""

import asyncio
import dataclasses
import hashlib
import json
import logging
from typing import Any

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from gateway.accounts.auth import Caller
from gateway.accounts.outage_claims import OutageClaims
from gateway.accounts.usage import HeldKey, Recovered, UsageJournal
from gateway.types import (
    ErrorKind,
    FinishReason,
    GatewayError,
    GenerationOutput,
    GenerationRequest,
    PhaseUsage,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)

log = logging.getLogger(__name__)

MAX_LEASE_S = 24 * 3600
COMPLETE_TIMEOUT_S = 2.0
# The largest answer stored under a key, as JSON: well inside the control plane's body limit (8 MiB).
MAX_STORED_ANSWER_BYTES = 4 * 2**20


def fingerprint(request: GenerationRequest) -> str:
    """The request's parameters, without the fields that only name it. Both fronts map a request into the
    same GenerationRequest, so a key's request means the same over gRPC and HTTP."""
    essence = dataclasses.replace(request, client_request_id="", idempotency_key="", resume_request_id="")
    return hashlib.sha256(json.dumps(dataclasses.asdict(essence), sort_keys=True).encode()).hexdigest()


class IdempotencyKeys:
    def __init__(self, control_plane: ControlPlaneClient, journal: UsageJournal) -> None:
        self._control_plane = control_plane
        self._journal = journal
        self._outage_claims = OutageClaims(control_plane, journal)
        self._background: set[asyncio.Task[bool]] = set()

    async def claim(
        self, caller: Caller, key: str, request: GenerationRequest, execution_id: str, lease_s: float
    ) -> list[GenerationOutput] | None:
        """None when this execution may run; the stored response (one output per choice) when a completed
        one of the same API key answers instead."""
        held = HeldKey(execution_id, caller.organization_id, key)
        # Journaled before it is claimed: a gateway killed in between frees a key it may hold.
        self._journal.hold_idempotency_key(held)
        body = {
            "organization_id": caller.organization_id,
            "key": key,
            "caller": f"api_key:{caller.api_key_id}",
            "fingerprint": fingerprint(request),
            "execution_id": execution_id,
            "lease_seconds": max(1, min(MAX_LEASE_S, round(lease_s))),
        }
        try:
            claim = await self._claim(held, body, request)
        except GatewayError:
            self._journal.drop_idempotency_key(execution_id)
            raise
        except asyncio.CancelledError:  # the caller went away; the control plane may have taken the claim
            self.release(caller.organization_id, key, execution_id)
            raise
        outcome = claim["outcome"]
        if outcome == "claimed" and not request.resume_request_id:
            return None
        if outcome == "claimed":  # nothing to resume: the key was free, and is again
            await self._release(held)
            raise _nothing_stored(request.resume_request_id)
        self._journal.drop_idempotency_key(execution_id)
        if outcome == "other_caller":
            raise GatewayError(
                ErrorKind.INVALID_ARGUMENT,
                "this idempotency key was already used by another API key of your organization; a stored answer "
                "goes only to the key that made the request: use a new idempotency key",
            )
        if outcome == "completed":
            replay = replayed_outputs(claim["response"])
            if request.resume_request_id and replay[0].request_id != request.resume_request_id:
                raise _nothing_stored(request.resume_request_id)
            return replay
        if outcome == "in_flight":
            raise GatewayError(
                ErrorKind.ABORTED,
                f"a request with this idempotency key is still running (request {claim['execution_id']}); "
                "retry after it has finished to get its result",
            )
        raise GatewayError(
            ErrorKind.INVALID_ARGUMENT,
            "this idempotency key was already used with different parameters; use a new key for a new request",
        )

    async def _claim(self, held: HeldKey, body: dict[str, Any], request: GenerationRequest) -> dict[str, Any]:
        """The control plane's answer to the claim; while it cannot be reached, the gateway's own."""
        here = self._outage_claims.find(held.organization_id, held.key)
        if here is not None:
            return self._outage_claims.outcome(here, body)
        if not self._outage_claims.outage:
            try:
                return await self._control_plane.claim_idempotency_key(body)
            except ControlPlaneUnavailable as error:
                log.warning("the control plane is unreachable (%r): claiming idempotency keys alone", error)
        if request.resume_request_id:
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                "cannot fetch what is stored under this idempotency key now (control plane unreachable); retry shortly",
            )
        self._outage_claims.claim(held, body)
        return {"outcome": "claimed", "execution_id": held.execution_id}

    async def complete(
        self, organization_id: str, key: str, execution_id: str, outputs: list[GenerationOutput]
    ) -> None:
        """Stores the whole result (one output per choice) under the key; while the control plane cannot be
        reached, in the gateway until it can. An answer too large to store, or one the control plane
        refuses, frees the key instead: a retry then runs anew."""
        response = stored_responses(outputs)
        size = len(json.dumps(response, separators=(",", ":"), ensure_ascii=False).encode())
        if size > MAX_STORED_ANSWER_BYTES:
            log.warning(
                "the answer of %s is %d bytes, over the %d an idempotency key stores; freeing its key",
                execution_id,
                size,
                MAX_STORED_ANSWER_BYTES,
            )
            self.release(organization_id, key, execution_id)
            return
        held = HeldKey(execution_id, organization_id, key)
        if self._outage_claims.outage or self._outage_claims.holds(execution_id):
            self._outage_claims.store(held, response)
            return
        body = {**held.as_body(), "response": response}
        try:
            await asyncio.wait_for(self._control_plane.complete_idempotency_key(body), COMPLETE_TIMEOUT_S)
        except (ControlPlaneUnavailable, TimeoutError) as error:
            log.warning("could not store the answer of %s under its key (%r); holding it here", execution_id, error)
            self._outage_claims.store(held, response)
            return
        except Exception as error:
            log.warning("the control plane refused the answer of %s (%r); freeing its key", execution_id, error)
            self.release(organization_id, key, execution_id)
            return
        self._journal.drop_idempotency_key(execution_id)

    def release(self, organization_id: str, key: str, execution_id: str) -> None:
        """In the background: the client does not wait for it. While the control plane cannot be reached,
        the key is freed in the gateway at once and there once it can be."""
        held = HeldKey(execution_id, organization_id, key)
        if self._outage_claims.outage or self._outage_claims.holds(execution_id):
            self._outage_claims.free(held)
            return
        task = asyncio.get_running_loop().create_task(self._release(held))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, held: HeldKey) -> bool:
        try:
            await self._control_plane.release_idempotency_key(held.as_body())
        except ControlPlaneUnavailable:  # freed here now, and there once the control plane can be reached
            self._outage_claims.free(held)
            return True
        except Exception as error:  # the journal keeps the key: the gateway frees it when it starts again
            log.warning("could not free the idempotency key of %s: %r", held.execution_id, error)
            return False
        self._journal.drop_idempotency_key(held.execution_id)
        return True

    def held_by_a_previous_run(self) -> list[HeldKey]:
        """The keys the journal holds as the gateway starts, before it claims any: a killed run's."""
        return self._journal.held_idempotency_keys()

    async def settle_held(self, held: list[HeldKey], recovered: list[Recovered], retry_s: float = 1.0) -> None:
        """Settles `held` (a killed run's keys), retrying those the control plane did not take until it does:
        the key of an execution that handed output over gets that output as its answer (finish reason
        `interrupted`), which is what it was billed for; any other key is freed, so a retry runs anew. The
        control plane settles only a key its execution still holds, so a key whose answer was stored, or
        whose lease ended and went to another execution, stays as it is."""
        answers = {r.execution_id: interrupted_answer(r) for r in recovered if r.outputs}
        while held:
            held = [key for key in held if not await self._settle(key, answers.get(key.execution_id))]
            if held:
                await asyncio.sleep(retry_s)
        for execution in recovered:
            self._journal.drop_outputs(execution.execution_id)

    async def _settle(self, held: HeldKey, answer: dict[str, Any] | None) -> bool:
        if answer is None:
            return await self._release(held)
        try:
            await self._control_plane.complete_idempotency_key({**held.as_body(), "response": answer})
        except Exception as error:
            log.warning("could not store the interrupted answer of %s under its key: %r", held.execution_id, error)
            return False
        self._journal.drop_idempotency_key(held.execution_id)
        return True

    async def wait_idle(self, timeout_s: float) -> None:
        """Lets the releases still in flight and the handover of keys held alone finish, for at most
        `timeout_s` each (a key not released in time is freed when its lease ends)."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)
        await self._outage_claims.wait_idle(timeout_s)


def _nothing_stored(execution_id: str) -> GatewayError:
    return GatewayError(
        ErrorKind.NOT_FOUND,
        f"nothing of request {execution_id} is stored under this idempotency key (it handed no output over, or "
        "its key's lease ended): send the request again under a new idempotency key",
    )


# The stored answer is a diptych.v1.GenerateResponse in proto3's JSON form: camelCase names, fields at their
# default value left out, enums by name, 64-bit integers as strings. A request of n > 1 choices stores
# {"choices": [one such response per choice, in order]}.


def stored_responses(outputs: list[GenerationOutput]) -> dict[str, Any]:
    if len(outputs) == 1:
        return stored_response(outputs[0])
    return {"choices": [stored_response(output) for output in outputs]}


def interrupted_answer(execution: Recovered) -> dict[str, Any]:
    """The answer of an execution cut mid-way, as billed: the outputs it handed over in one, finish reason
    `interrupted`, and the usage of its events."""
    answer: dict[str, Any] = {
        "requestId": execution.execution_id,
        "finishReason": _FINISH_NAMES[FinishReason.INTERRUPTED],
    }
    text = "".join(output.get("text", "") for output in execution.outputs)
    token_ids = [token for output in execution.outputs for token in output.get("tokenIds", [])]
    logprobs = [entry for output in execution.outputs for entry in output.get("logprobs", [])]
    answer |= _without_defaults({"text": text, "tokenIds": token_ids, "logprobs": logprobs})
    phases = {event.phase: event for event in execution.events}
    prefill, decode = phases.get("prefill"), phases.get("decode")
    answer["usage"] = _without_defaults(
        {
            "promptTokens": prefill.tokens if prefill else 0,
            "completionTokens": decode.tokens if decode else 0,
            "cachedTokens": prefill.cached_tokens if prefill else 0,
        }
    )
    for name, event in (("prefill", prefill), ("decode", decode)):
        if event is not None:
            answer["usage"][name] = _without_defaults(
                {
                    "tokens": event.tokens,
                    "cachedTokens": event.cached_tokens,
                    "kvBytes": str(event.kv_bytes) if event.kv_bytes else None,
                    "computeMs": event.compute_ms,
                    "workerId": event.worker_id,
                }
            )
    return answer


def replayed_outputs(body: dict[str, Any]) -> list[GenerationOutput]:
    if "choices" in body:
        return [replayed_output(choice) for choice in body["choices"]]
    return [replayed_output(body)]


_FINISH_NAMES = {
    FinishReason.STOP: "FINISH_REASON_STOP",
    FinishReason.LENGTH: "FINISH_REASON_LENGTH",
    FinishReason.TOOL_CALLS: "FINISH_REASON_TOOL_CALLS",
    FinishReason.INTERRUPTED: "FINISH_REASON_INTERRUPTED",
}
_FINISH_BY_NAME = {name: reason for reason, name in _FINISH_NAMES.items()}


def stored_response(output: GenerationOutput) -> dict[str, Any]:
    body = _without_defaults(
        {
            "requestId": output.request_id,
            "text": output.text,
            "tokenIds": list(output.token_ids),
            "finishReason": _FINISH_NAMES[output.finish_reason] if output.finish_reason is not None else None,
            "index": output.index,
        }
    )
    if output.logprobs is not None:
        body["logprobs"] = stored_logprobs(output.logprobs)
    if output.tool_calls:
        body["toolCalls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in output.tool_calls]
    if output.usage is not None:
        usage = output.usage
        body["usage"] = _without_defaults(
            {
                "promptTokens": usage.prompt_tokens,
                "completionTokens": usage.completion_tokens,
                "cachedTokens": usage.cached_tokens,
            }
        )
        for name, phase in (("prefill", usage.prefill), ("decode", usage.decode)):
            if phase is not None:
                body["usage"][name] = _without_defaults(
                    {
                        "tokens": phase.tokens,
                        "cachedTokens": phase.cached_tokens,
                        "kvBytes": str(phase.kv_bytes) if phase.kv_bytes else None,
                        "computeMs": phase.compute_ms,
                        "workerId": phase.worker_id,
                    }
                )
    return body


def stored_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [_stored_logprob(entry) for entry in entries]


def _stored_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "tokenId": entry.token_id,
        "token": entry.token,
        "logprob": entry.logprob,
        "topLogprobs": [{"tokenId": t.token_id, "token": t.token, "logprob": t.logprob} for t in entry.top_logprobs],
    }


def _replayed_logprob(body: dict[str, Any]) -> TokenLogprob:
    top = tuple(_replayed_top(t) for t in body.get("topLogprobs", []))
    return TokenLogprob(int(body.get("tokenId", 0)), body.get("token", ""), float(body.get("logprob", 0.0)), top)


def _replayed_top(body: dict[str, Any]) -> TopLogprob:
    return TopLogprob(int(body.get("tokenId", 0)), body.get("token", ""), float(body.get("logprob", 0.0)))


def replayed_output(body: dict[str, Any]) -> GenerationOutput:
    usage = body.get("usage")
    return GenerationOutput(
        request_id=body.get("requestId", ""),
        text=body.get("text", ""),
        token_ids=[int(token) for token in body.get("tokenIds", [])],
        finish_reason=_FINISH_BY_NAME.get(body.get("finishReason", "")),
        index=int(body.get("index", 0)),
        tool_calls=tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in body.get("toolCalls", [])),
        logprobs=[_replayed_logprob(entry) for entry in body["logprobs"]] if "logprobs" in body else None,
        usage=None
        if usage is None
        else Usage(
            prompt_tokens=int(usage.get("promptTokens", 0)),
            completion_tokens=int(usage.get("completionTokens", 0)),
            cached_tokens=int(usage.get("cachedTokens", 0)),
            prefill=_phase_usage(usage.get("prefill")),
            decode=_phase_usage(usage.get("decode")),
        ),
    )


def _phase_usage(body: dict[str, Any] | None) -> PhaseUsage | None:
    if body is None:
        return None
    return PhaseUsage(
        tokens=int(body.get("tokens", 0)),
        cached_tokens=int(body.get("cachedTokens", 0)),
        kv_bytes=int(body.get("kvBytes", 0)),
        compute_ms=int(body.get("computeMs", 0)),
        worker_id=body.get("workerId", ""),
    )


def _without_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value not in (None, 0, "", [])}
