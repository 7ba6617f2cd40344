"""OpenAI's Responses API on the gateway's HTTP front: `POST /v1/responses` (whole, streamed as typed
server-sent events, or in the background), `GET` and `DELETE /v1/responses/{id}`, `POST
/v1/responses/{id}/cancel` and `GET /v1/responses/{id}/input_items`.

A response runs through the same pipeline as a chat completion (authentication, rate and spend limits,
idempotency keys, routing, metering): its prompt is rendered here (`responses_prompt.py`) and handed over as
token ids. A stored response (`store`, the default) is kept by the control plane with its token ids, so that
one continuing it (`previous_response_id`) runs on them extended and hits the prefix cache. Its id is its
execution's (`resp_` and the execution's hex), so a request replayed under its idempotency key names the
same response.

A background response is answered at once (`queued`) and runs in a task of this gateway; a cancel reaches it
here directly, or, when another gateway got the cancel, through the stored status it polls. It stops at its
next token: what it produced until then is billed, once, and kept as its output.
"""

import asyncio
import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing, suppress
from typing import Any

import httpx
from aiohttp import web

from diptych_common.internal_api.client import ControlPlaneUnavailable
from gateway.accounts.auth import Caller
from gateway.accounts.ratelimit_headers import Metadata
from gateway.bodies import BodyRefused, read_body
from gateway.core.pipeline import Admitted, Pipeline
from gateway.metrics import count_request
from gateway.openai_api.errors import error_response, execution_error, json_error
from gateway.openai_api.requests import HttpError
from gateway.openai_api.responses_events import ResponseEvents, sse
from gateway.openai_api.responses_objects import (
    ProducedOutput,
    ResponseRecord,
    error_object,
    response_json,
)
from gateway.openai_api.responses_prompt import EarlierConversation, PromptRefused, response_prompt
from gateway.openai_api.responses_request import KNOWN, ResponsesRequest, function_tools, to_responses_request
from gateway.openai_api.responses_store import ResponseStore, StoreFailed
from gateway.openai_api.server import REQUEST_ID_HEADER
from gateway.planning.json_body import JsonRefused, read_body_off_loop
from gateway.planning.tokenization import run_off_loop, tokenizer_for
from gateway.types import ErrorKind, GatewayError, GenerationRequest, as_told

log = logging.getLogger(__name__)

NO_METADATA: Metadata = ()  # before the caller is authenticated: no rate-limit state to tell
CANCEL_POLL_S = 1.0  # how often a background response looks for a cancel another gateway stored
RESPONSE_ID = re.compile(r"resp_[0-9A-Za-z]{1,59}")
CONTINUABLE = ("completed", "incomplete")
INPUT_ITEMS_QUERY = frozenset({"limit", "after", "order", "include"})

# what `_on_stored` answers: action(caller, response_id, query), the answer's JSON body
StoredAction = Callable[[Caller, str, Mapping[str, str]], Awaitable[dict[str, Any]]]


class ResponsesApi:
    def __init__(self, pipeline: Pipeline, store: ResponseStore) -> None:
        self._pipeline = pipeline
        self._store = store
        self._running: dict[str, asyncio.Task[None]] = {}  # the background responses this gateway runs, by id

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.input_items)

    # ---- create ----------------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        peer, limits = request.remote or "", NO_METADATA
        try:
            authorization = _authorization(request)
            caller, limits = await self._pipeline.authenticate(authorization, peer)
            asked = to_responses_request(await _json_body(request))
            key = _idempotency_key(request)
            generation, record = await self._prepare(caller, asked, key)
        except (HttpError, BodyRefused, PromptRefused, GatewayError) as refused:
            # Refused before the pipeline saw it: counted here, as the pipeline counts its own refusals.
            kind = refused.kind if isinstance(refused, GatewayError) else ErrorKind.INVALID_ARGUMENT
            count_request("", "", kind.value, "http")
            return _refusal(refused, limits)
        try:
            admitted = await self._pipeline.admit(authorization, generation, "http", peer)
        except GatewayError as error:
            error.rate_limit_metadata = error.rate_limit_metadata or limits
            return error_response(error, "input")
        record.id = response_id_of(admitted.execution_id)
        try:
            if admitted.replay is not None and asked.store:
                stored = await self._stored_replay(record, admitted)
                if stored is not None:
                    return stored
            if asked.background:
                return await self._start_in_background(admitted, record)
            if asked.stream:
                return await self._stream(request, admitted, record, asked)
            return await self._whole(admitted, record, asked)
        finally:
            if record.id not in self._running:  # a run in the background frees what it holds itself
                self._pipeline.abandon(admitted)  # frees what it holds if it never ran (its client went away)

    async def _prepare(
        self, caller: Caller, asked: ResponsesRequest, idempotency_key: str
    ) -> tuple[GenerationRequest, ResponseRecord]:
        """The generation to admit and the record of its response: the prompt rendered (continuing the
        stored conversation it names), off the event loop on the caller's share of the tokenizer threads."""
        model = self._pipeline.registry.models.get(asked.model)
        if model is None:
            available = ", ".join(sorted(self._pipeline.registry.models)) or "none"
            message = f"model {asked.model[:64]!r} does not exist; available models: {available}"
            raise GatewayError(ErrorKind.NOT_FOUND, message)
        earlier, context_items = await self._earlier(caller, asked.previous_response_id)
        tokenizer = await run_off_loop(tokenizer_for, model.source)
        prompt = await run_off_loop(
            response_prompt,
            tokenizer,
            model,
            asked.instructions,
            asked.tools,
            asked.items,
            earlier,
            asked.max_output_tokens or 1,
            asked.truncation == "auto",
            tenant=caller.organization_id,
        )
        # A chat rendered here: its token ids are the prompt (validation takes prompt_token_ids before chat), and
        # the chat makes it one to the planning (tools; without max_output_tokens it may run to the end of the
        # context, and the rate limits reserve a chat's estimate). docs/gateway.md, "Responses".
        generation = GenerationRequest(
            model=model.name,
            prompt_token_ids=prompt.token_ids,
            chat=prompt.messages,
            max_tokens=asked.max_output_tokens,
            temperature=asked.temperature,
            top_p=asked.top_p,
            seed=asked.seed,
            client_request_id=asked.user,
            idempotency_key=idempotency_key,
            prompt_cache_key=asked.prompt_cache_key,
            response_format=asked.response_format,
            tools=asked.tools,
            tool_choice=asked.tool_choice,
            parallel_tool_calls=asked.parallel_tool_calls,
        )
        record = ResponseRecord(
            id="",
            organization_id=caller.organization_id,
            api_key_id=caller.api_key_id,
            model=model.name,
            request=asked.echoed,
            metadata=asked.metadata,
            context_items=context_items,
            input_items=asked.items,
            prompt_token_ids=prompt.token_ids,
        )
        return generation, record

    async def _earlier(
        self, caller: Caller, previous_id: str | None
    ) -> tuple[EarlierConversation | None, list[dict[str, Any]]]:
        """The stored conversation a response continues, and its items (the new response's context)."""
        if previous_id is None:
            return None, []
        previous = await self._fetch(caller.organization_id, previous_id)
        if previous is None:
            raise HttpError(f"previous_response_id: no stored response {previous_id!r}", "previous_response_id", 404)
        if previous.status not in CONTINUABLE:
            raise HttpError(
                f"previous_response_id: response {previous_id} is {previous.status}; continue a completed or "
                "incomplete response",
                "previous_response_id",
            )
        before_output = previous.context_items + previous.input_items
        earlier = EarlierConversation(
            model=previous.model,
            token_ids=previous.prompt_token_ids + previous.output_token_ids,
            items_before_output=before_output,
            output_items=previous.output_items,
            instructions=previous.request.get("instructions"),
            tools=function_tools(previous.request.get("tools") or None)[0],
        )
        return earlier, before_output + previous.output_items

    async def _whole(self, admitted: Admitted, record: ResponseRecord, asked: ResponsesRequest) -> web.Response:
        produced = ProducedOutput()
        try:
            async with aclosing(self._pipeline.generate(admitted, whole=True)) as outputs:
                async for output in outputs:
                    produced.push(output)
        except GatewayError as error:
            return execution_error(error, admitted)
        record.ended(produced)
        if asked.store:
            await self._keep(record)
        return web.json_response(response_json(record), headers=_response_headers(admitted))

    async def _stream(
        self, request: web.Request, admitted: Admitted, record: ResponseRecord, asked: ResponsesRequest
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_response_headers(admitted)}
        )
        await response.prepare(request)
        produced = ProducedOutput()
        events = ResponseEvents(record, produced)
        try:
            await _send(response, events.opening())
            async with aclosing(self._pipeline.generate(admitted)) as outputs:
                async for output in outputs:
                    produced.push(output)
                    await _send(response, events.text(output.text))
            record.ended(produced)
            ending = events.closing
        except GatewayError as error:
            record.finish("failed", produced, _failure(error, admitted.execution_id))
            ending = events.failed
        except ConnectionError:  # the client went away: leaving the pipeline cancelled the workers' calls
            return response
        if asked.store:
            await self._keep(record)
        with suppress(ConnectionError):
            await _send(response, ending())
            await response.write_eof()
        return response

    async def _stored_replay(self, record: ResponseRecord, admitted: Admitted) -> web.Response | None:
        """A request replayed under its idempotency key gets the response its first run stored."""
        stored = await self._fetch(record.organization_id, record.id)
        if stored is None:
            return None
        return web.json_response(response_json(stored), headers=_response_headers(admitted))

    # ---- background ------------------------------------------------------------------------------------

    async def _start_in_background(self, admitted: Admitted, record: ResponseRecord) -> web.Response:
        record.status = "queued"
        await self._keep(record)
        task = asyncio.get_running_loop().create_task(self._run_in_background(admitted, record))
        self._running[record.id] = task
        task.add_done_callback(lambda _: self._running.pop(record.id, None))
        task.add_done_callback(lambda _: self._pipeline.abandon(admitted))  # a task cancelled before it began
        return web.json_response(response_json(record), headers=_response_headers(admitted))

    async def _run_in_background(self, admitted: Admitted, record: ResponseRecord) -> None:
        produced = ProducedOutput()
        watch = asyncio.create_task(self._watch_for_cancel(record, asyncio.current_task()))
        progress: asyncio.Task[str | None] | None = None
        try:
            async with aclosing(self._pipeline.generate(admitted)) as outputs:
                async for output in outputs:
                    if progress is None:  # stored beside the run: a cancel must not interrupt it
                        progress = asyncio.create_task(
                            self._keep(dataclasses.replace(record, status="in_progress"), create=False)
                        )
                    produced.push(output)
            record.ended(produced)
        except asyncio.CancelledError:
            record.finish("cancelled", produced)
        except GatewayError as error:
            record.finish("failed", produced, _failure(error, admitted.execution_id))
        except Exception:  # a defect of ours: the response fails, rather than stay in progress for ever
            log.exception("background response %s failed", record.id)
            failure = GatewayError(ErrorKind.INTERNAL, "the response failed inside the gateway")
            record.finish("failed", produced, _failure(failure, admitted.execution_id))
        finally:
            watch.cancel()
        if progress is not None:
            await progress
        await self._keep(record, create=False)

    async def _watch_for_cancel(self, record: ResponseRecord, run: asyncio.Task[Any] | None) -> None:
        """Cancels `run` once the stored status says cancelled (a cancel another gateway received)."""
        while run is not None:
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                status = await self._store.status(record.organization_id, record.id)
            except (ControlPlaneUnavailable, httpx.HTTPError):
                continue
            if status in ("cancelled", None):  # cancelled, or deleted
                run.cancel()
                return

    async def _keep(self, record: ResponseRecord, create: bool = True) -> str | None:
        """Stores the record; a response the control plane could not take is answered all the same (logged)."""
        try:
            return await self._store.store(record, create)
        except StoreFailed as error:
            log.warning("response %s (%s) was not stored: %s", record.id, record.status, error)
            return None

    # ---- stored responses ------------------------------------------------------------------------------

    async def retrieve(self, request: web.Request) -> web.Response:
        return await self._on_stored(request, self._retrieved, frozenset({"include", "stream"}))

    async def delete(self, request: web.Request) -> web.Response:
        return await self._on_stored(request, self._deleted)

    async def cancel(self, request: web.Request) -> web.Response:
        return await self._on_stored(request, self._cancelled)

    async def input_items(self, request: web.Request) -> web.Response:
        return await self._on_stored(request, self._listed, INPUT_ITEMS_QUERY)

    async def _on_stored(
        self, request: web.Request, action: StoredAction, query_names: frozenset[str] = frozenset()
    ) -> web.Response:
        """Authenticates, checks the id and the query, and answers `action(caller, response_id, query)`."""
        limits = NO_METADATA
        try:
            caller, limits = await self._pipeline.authenticate(_authorization(request), request.remote or "")
            unknown = sorted(set(request.query) - query_names)
            if unknown:
                raise HttpError(f"{unknown[0][:40]!r} is not a query parameter of {request.path}", unknown[0][:40])
            response_id = request.match_info["response_id"]
            if not RESPONSE_ID.fullmatch(response_id):
                raise _not_found(response_id)
            answer = await action(caller, response_id, request.query)
        except HttpError as error:
            return _refused(error.status, error.message, error.param, limits)
        except GatewayError as error:
            error.rate_limit_metadata = error.rate_limit_metadata or limits
            return error_response(error)
        except ControlPlaneUnavailable:
            unavailable = GatewayError(
                ErrorKind.UNAVAILABLE, "stored responses are unavailable right now; retry shortly"
            )
            unavailable.rate_limit_metadata = limits
            return error_response(unavailable)
        return web.json_response(answer, headers=dict(limits))

    async def _retrieved(self, caller: Caller, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        if query.get("stream") not in (None, "false"):
            raise HttpError("streaming a stored response is not offered; GET it without stream", "stream")
        if query.get("include"):
            raise HttpError("include cannot be honoured here; remove it", "include")
        record = await self._fetch(caller.organization_id, response_id)
        if record is None:
            raise _not_found(response_id)
        return response_json(record)

    async def _deleted(self, caller: Caller, response_id: str, _query: Mapping[str, str]) -> dict[str, Any]:
        if not await self._store.delete(caller.organization_id, response_id):
            raise _not_found(response_id)
        running = self._running.get(response_id)
        if running is not None:
            running.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    async def _cancelled(self, caller: Caller, response_id: str, _query: Mapping[str, str]) -> dict[str, Any]:
        try:
            record = await self._store.cancel(caller.organization_id, response_id)
        except httpx.HTTPStatusError as error:
            raise HttpError(_control_plane_message(error), None) from None
        if record is None:
            raise _not_found(response_id)
        running = self._running.get(response_id)
        if running is not None:  # run here: stopped now, and its output stored before the answer
            running.cancel()
            await asyncio.wait({running})
            record = await self._fetch(caller.organization_id, response_id) or record
        return response_json(record)

    async def _listed(self, caller: Caller, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        if query.get("include"):
            raise HttpError("include cannot be honoured here; remove it", "include")
        forwarded = {name: query[name] for name in ("limit", "after", "order") if name in query}
        try:
            page = await self._store.input_items(caller.organization_id, response_id, forwarded)
        except httpx.HTTPStatusError as error:
            raise HttpError(_control_plane_message(error), None) from None
        if page is None:
            raise _not_found(response_id)
        return page

    async def _fetch(self, organization_id: str, response_id: str) -> ResponseRecord | None:
        try:
            return await self._store.fetch(organization_id, response_id)
        except ControlPlaneUnavailable:
            raise GatewayError(
                ErrorKind.UNAVAILABLE, "stored responses are unavailable right now; retry shortly"
            ) from None


def response_id_of(execution_id: str) -> str:
    """`exec_<hex>` -> `resp_<hex>`: a response is named by the execution that produced it."""
    return "resp_" + execution_id.removeprefix("exec_")


def _failure(error: GatewayError, execution_id: str) -> dict[str, Any]:
    told = as_told(error, execution_id)
    code = "rate_limit_exceeded" if error.kind is ErrorKind.RESOURCE_EXHAUSTED else "server_error"
    return error_object(code, told.message)


async def _send(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    if events:
        await response.write(b"".join(sse(event) for event in events))


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request)
    try:
        return await read_body_off_loop(raw, KNOWN)
    except JsonRefused as error:
        raise HttpError(error.message, error.param) from None


def _authorization(request: web.Request) -> str | None:
    value = request.headers.get("Authorization")
    if value is not None and not (value.isascii() and value.isprintable()):
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            "the Authorization header holds characters that are not printable ASCII; send 'Bearer <api key>'",
        )
    return value


def _idempotency_key(request: web.Request) -> str:
    value = request.headers.get("Idempotency-Key", "")
    if not (value.isascii() and value.isprintable()):
        raise HttpError(
            "the Idempotency-Key header holds characters that are not printable ASCII; send a printable ASCII key",
            "idempotency_key",
        )
    return value


def _response_headers(admitted: Admitted) -> dict[str, str]:
    names = {"request-id": REQUEST_ID_HEADER, "idempotent-replayed": "Idempotent-Replayed"}
    return {names.get(key, key): value for key, value in admitted.response_metadata}


def _refusal(refused: HttpError | BodyRefused | PromptRefused | GatewayError, limits: Metadata) -> web.Response:
    if isinstance(refused, HttpError):
        return _refused(refused.status, refused.message, refused.param, limits)
    if isinstance(refused, BodyRefused):
        return _refused(refused.status, refused.message, None, limits)
    if isinstance(refused, PromptRefused):
        return _refused(400, refused.message, "input", limits, refused.code)
    refused.rate_limit_metadata = refused.rate_limit_metadata or limits
    return error_response(refused, "input")


def _refused(status: int, message: str, param: str | None, limits: Metadata, code: str | None = None) -> web.Response:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    response = json_error(status, kind, message, param)
    if code is not None:
        response = web.json_response(
            {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status
        )
    response.headers.update(dict(limits))
    return response


def _not_found(response_id: str) -> HttpError:
    shown = response_id if len(response_id) <= 64 else response_id[:61] + "..."
    return HttpError(f"no stored response {shown!r}", None, 404)


def _control_plane_message(error: httpx.HTTPStatusError) -> str:
    """The control plane's refusal, in its own words (its error shape: {"error": {"message": ...}})."""
    try:
        return str(error.response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "the request was refused"
