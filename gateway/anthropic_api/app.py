"""The Messages API's routes: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`.
A message is admitted and run by the same pipeline as a chat completion (authentication, rate and spend
limits, idempotency keys, routing, metering), its outputs and errors answered in Anthropic's shapes."""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from functools import wraps
from typing import Any

from aiohttp import web

from gateway.anthropic_api.cache import marked_tokens, usage_json
from gateway.anthropic_api.errors import (
    error_response,
    execution_error,
    gateway_error_body,
    new_answer_id,
    refusal,
)
from gateway.anthropic_api.events import MessageEvents
from gateway.anthropic_api.headers import (
    answer_headers,
    authorization,
    idempotency_key,
    rate_limit_headers,
    request_id_headers,
)
from gateway.anthropic_api.params import COUNT_TOKENS, MESSAGES, BadRequest, check_headers
from gateway.anthropic_api.requests import MessagesRequest, count_tokens_request, messages_request
from gateway.anthropic_api.responses import content_blocks, message_json, stop_reason
from gateway.bodies import BodyRefused, read_body
from gateway.core.pipeline import Admitted, Pipeline
from gateway.metrics import count_request
from gateway.planning.json_body import JsonRefused, read_body_off_loop
from gateway.planning.validation import plan_generation
from gateway.types import ErrorKind, GatewayError, GenerationOutput, GenerationPlan, GenerationRequest, Usage, as_told

log = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def add_routes(app: web.Application, pipeline: Pipeline) -> None:
    api = MessagesApi(pipeline)
    app.router.add_post(MESSAGES_PATH, api.messages)
    app.router.add_route("*", MESSAGES_PATH, api.post_only)
    app.router.add_post(COUNT_TOKENS_PATH, api.count_tokens)
    app.router.add_route("*", COUNT_TOKENS_PATH, api.post_only)
    app.router.add_route("*", MESSAGES_PATH + "/{rest:.*}", api.not_served)


_Handler = Callable[["MessagesApi", web.Request], Awaitable[web.StreamResponse]]


def _answering(handler: _Handler) -> _Handler:
    """A defect of ours is a 500 in Anthropic's shape (the HTTP app's own middleware would answer OpenAI's)."""

    @wraps(handler)
    async def answer(self: "MessagesApi", request: web.Request) -> web.StreamResponse:
        try:
            return await handler(self, request)
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.path)
            return refusal(500, "the gateway failed to answer this request; retry it", new_answer_id())

    return answer


class MessagesApi:
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    @_answering
    async def messages(self, request: web.Request) -> web.StreamResponse:
        answer_id = new_answer_id()
        try:
            check_headers(request)
            asked = messages_request(await _json_body(request, MESSAGES), _idempotency_key(request))
            caller_authorization = authorization(request)
        except (BadRequest, BodyRefused, GatewayError) as refused:
            # Refused before the pipeline saw it: counted here, as the pipeline counts its own refusals.
            kind = refused.kind if isinstance(refused, GatewayError) else ErrorKind.INVALID_ARGUMENT
            count_request("", "", kind.value, "http")
            if isinstance(refused, GatewayError):
                return error_response(refused, answer_id)
            return refusal(refused.status, refused.message, answer_id)
        try:
            admitted = await self._pipeline.admit(caller_authorization, asked.generation, "http", request.remote or "")
        except GatewayError as error:
            return error_response(error, answer_id)
        marked = self._count_marked_tokens(asked, admitted.plan)
        try:
            if asked.stream:
                return await self._stream(request, admitted, marked)
            return await self._whole(admitted, marked)
        finally:
            marked.cancel()
            self._pipeline.abandon(admitted)  # frees what it holds if it never ran (its client went away first)

    @_answering
    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt tokens of the conversation, by the model's tokenizer and chat template: the input_tokens,
        cache figures included, its message would have. It takes nothing from the rate limits."""
        answer_id = new_answer_id()
        try:
            check_headers(request)
            asked = count_tokens_request(await _json_body(request, COUNT_TOKENS))
            caller, limits = await self._pipeline.authenticate(authorization(request), request.remote or "")
            try:
                plan = await plan_generation(asked, self._pipeline.registry, caller.organization_id)
            except GatewayError as error:
                error.rate_limit_metadata = limits
                raise
        except (BadRequest, BodyRefused) as refused:
            return refusal(refused.status, refused.message, answer_id)
        except GatewayError as error:
            return error_response(error, answer_id)
        headers = request_id_headers(answer_id) | rate_limit_headers(limits)
        return web.json_response({"input_tokens": len(plan.prompt_token_ids)}, headers=headers)

    async def post_only(self, request: web.Request) -> web.Response:
        answer = refusal(405, f"{request.method} {request.path} is not served; send POST", new_answer_id())
        answer.headers["Allow"] = "POST"
        return answer

    async def not_served(self, request: web.Request) -> web.Response:
        return refusal(
            404,
            f"{request.path} is not served; the Messages API here is POST {MESSAGES_PATH} and POST {COUNT_TOKENS_PATH}",
            new_answer_id(),
        )

    async def _whole(self, admitted: Admitted, marked: asyncio.Future[int]) -> web.Response:
        texts: list[str] = []
        token_ids: list[int] = []
        last: GenerationOutput | None = None
        try:
            async with aclosing(self._pipeline.generate(admitted, whole=True)) as outputs:
                async for last in outputs:
                    texts.append(last.text)
                    token_ids += last.token_ids
            if last is None:  # the pipeline ends every execution with an output or an error
                raise GatewayError(ErrorKind.INTERNAL, "the generation ended without a response")
            usage = usage_json(_usage(admitted.plan, last, token_ids), await marked)
        except GatewayError as error:
            return execution_error(error, admitted.execution_id)
        text, plan = "".join(texts), admitted.plan
        message = message_json(
            admitted.execution_id,
            plan.model.name,
            content_blocks(text, last.tool_calls),
            stop_reason(last, text, token_ids, plan.stop, plan.tokenizer),
            usage,
        )
        return web.json_response(message, headers=answer_headers(admitted.response_metadata))

    async def _stream(
        self, request: web.Request, admitted: Admitted, marked: asyncio.Future[int]
    ) -> web.StreamResponse:
        """message_start carries the prompt's tokens as input_tokens and no cache figures: the platform reports
        the cached tokens once the request ends, and message_delta carries the final usage."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers | answer_headers(admitted.response_metadata))
        await response.prepare(request)
        events, plan = MessageEvents(response), admitted.plan
        prompt = Usage(len(plan.prompt_token_ids), 0, 0)
        texts: list[str] = []
        token_ids: list[int] = []
        last: GenerationOutput | None = None
        try:
            await events.start(
                message_json(admitted.execution_id, plan.model.name, [], (None, None), usage_json(prompt, 0))
            )
            try:
                async with aclosing(self._pipeline.generate(admitted)) as outputs:
                    async for last in outputs:
                        texts.append(last.text)
                        token_ids += last.token_ids
                        await events.text(last.text)
                        if last.tool_calls:
                            await events.tool_uses(last.tool_calls)
                if last is None:
                    raise GatewayError(ErrorKind.INTERNAL, "the generation ended without a response")
                usage = usage_json(_usage(plan, last, token_ids), await marked)
                await events.finish(stop_reason(last, "".join(texts), token_ids, plan.stop, plan.tokenizer), usage)
            except GatewayError as error:
                await events.error(gateway_error_body(as_told(error, admitted.execution_id), admitted.execution_id))
            except Exception:  # a defect of ours, once the answer started: its error event, as any failure's
                log.exception("unexpected error streaming %s", admitted.execution_id)
                failed = GatewayError(ErrorKind.INTERNAL, "the stream failed")
                await events.error(gateway_error_body(as_told(failed, admitted.execution_id), admitted.execution_id))
            await response.write_eof()
        except ConnectionError:  # the client went away: leaving the pipeline cancelled the workers' calls
            pass
        return response

    def _count_marked_tokens(self, asked: MessagesRequest, plan: GenerationPlan) -> asyncio.Future[int]:
        """The prompt's tokens up to the last cache breakpoint, counted beside the generation (0 at once
        without a breakpoint)."""
        if asked.cache_prefix is None:
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            done.set_result(0)
            return done
        return asyncio.ensure_future(self._marked_tokens(asked.cache_prefix, plan))

    async def _marked_tokens(self, prefix: GenerationRequest, plan: GenerationPlan) -> int:
        """0 when they cannot be counted: the answer is not failed for a figure of its usage."""
        try:
            return await marked_tokens(prefix, plan, self._pipeline.registry)
        except GatewayError as error:
            log.warning("no cache breakpoint figure for %s: %s", plan.request_id, error.message)
            return 0


def _usage(plan: GenerationPlan, last: GenerationOutput, token_ids: list[int]) -> Usage:
    """The usage the last output carries (a replay's as stored), or what the plan and the tokens say."""
    return last.usage or Usage(len(plan.prompt_token_ids), len(token_ids), 0)


async def _json_body(request: web.Request, known: frozenset[str]) -> dict[str, Any]:
    raw = await read_body(request)
    try:
        return await read_body_off_loop(raw, known)
    except JsonRefused as error:
        raise BadRequest(error.message) from None


def _idempotency_key(request: web.Request) -> str:
    key = idempotency_key(request)
    if key is None:
        raise BadRequest(
            "the Idempotency-Key header holds characters that are not printable ASCII; send a printable ASCII key"
        )
    return key
