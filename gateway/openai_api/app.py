"""The OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`,
with server-sent-event streaming. It maps each request into the gateway's GenerationRequest and runs it
through the same pipeline as the gRPC API (same routing, limits and metering), then maps the pipeline's
outputs and errors into OpenAI's shapes. It runs in the gateway's event loop, next to grpc.aio.
"""

import asyncio
from collections.abc import Coroutine
from contextlib import aclosing
from typing import Any

from aiohttp import web

from gateway.anthropic_api.app import add_routes as add_messages_routes
from gateway.bodies import MAX_BODY_BYTES, BodyRefused, read_body
from gateway.core.pipeline import Admitted, Pipeline
from gateway.metrics import count_request
from gateway.openai_api.batches import BatchApiProxy
from gateway.openai_api.errors import (
    aiohttp_errors_as_json,
    error_body,
    error_response,
    execution_error,
    json_error,
    json_errors,
)
from gateway.openai_api.requests import KNOWN_PARAMS, HttpError, flag, stream_options, to_generation_request
from gateway.openai_api.responses import Shape, model_json, send_event, system_fingerprint
from gateway.openai_api.responses_api import ResponsesApi
from gateway.openai_api.responses_store import ResponseStore
from gateway.openai_api.server import REQUEST_ID_HEADER, name_answer
from gateway.openai_api.timing import timed_generations
from gateway.openai_api.tools import tool_call_deltas
from gateway.planning.json_body import JsonRefused, read_body_off_loop, start_parsers
from gateway.types import ErrorKind, GatewayError, GenerationOutput, TokenLogprob, as_told


def build_app(
    pipeline: Pipeline, batch_api: BatchApiProxy | None = None, responses_store: ResponseStore | None = None
) -> web.Application:
    """`batch_api` serves /v1/files and /v1/batches (the control plane keeps them); `responses_store`, the
    stored responses of /v1/responses."""
    api = OpenAiApi(pipeline)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[timed_generations, json_errors])
    app.on_startup.append(start_parsers)
    app.on_response_prepare.append(_name_answer)
    app.on_response_prepare.append(aiohttp_errors_as_json)
    if batch_api is not None:
        batch_api.add_routes(app)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    if responses_store is not None:
        ResponsesApi(pipeline, responses_store).add_routes(app)  # OpenAI's Responses API (responses_api.py)
    add_messages_routes(app, pipeline)  # Anthropic's Messages API (gateway/anthropic_api)
    app.router.add_get("/health", api.health)
    # No /metrics here: this port is public, and metrics name models, workers and volumes. Prometheus and
    # benchmark tools scrape the gateway's --metrics-port, on the private network.
    return app


class OpenAiApi:
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self._unattended: set[asyncio.Task[web.StreamResponse]] = set()  # batch lines whose runner went away

    async def health(self, _request: web.Request) -> web.Response:
        if self._pipeline.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        try:
            _, limits = await self._pipeline.authenticate(_authorization(request), request.remote or "")
        except GatewayError as error:
            return error_response(error)
        registry = self._pipeline.registry.models
        models = [model_json(registry[name]) for name in sorted(registry)]
        return web.json_response({"object": "list", "data": models}, headers=dict(limits))

    async def model(self, request: web.Request) -> web.Response:
        try:
            _, limits = await self._pipeline.authenticate(_authorization(request), request.remote or "")
        except GatewayError as error:
            return error_response(error)
        name = request.match_info["model"]
        if name not in self._pipeline.registry.models:
            missing = GatewayError(ErrorKind.NOT_FOUND, f"model '{name}' does not exist")
            missing.rate_limit_metadata = limits
            return error_response(missing)
        return web.json_response(model_json(self._pipeline.registry.models[name]), headers=dict(limits))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body: dict[str, Any] = {}
        prompt_param = "messages" if chat else "prompt"
        try:
            body = await _json_body(request)
            generation_request = to_generation_request(body, chat, _idempotency_key(request))
            stream = flag(body, "stream")
            include_usage, running_usage = stream_options(body)
            authorization = _authorization(request)
        except (HttpError, BodyRefused, GatewayError) as refused:
            # Refused before the pipeline saw it: counted here, as the pipeline counts its own refusals.
            kind = refused.kind if isinstance(refused, GatewayError) else ErrorKind.INVALID_ARGUMENT
            count_request(self._model_label(body), "", kind.value, "http")
            if isinstance(refused, GatewayError):
                return error_response(refused, prompt_param)
            return json_error(refused.status, "invalid_request_error", refused.message, _param_of(refused))
        try:
            admitted = await self._pipeline.admit(authorization, generation_request, "http", request.remote or "")
        except GatewayError as error:
            return error_response(error, prompt_param)
        fingerprint = system_fingerprint(admitted.plan.model)
        shape = Shape(admitted.execution_id, generation_request.model, chat, admitted.plan.tokenizer, fingerprint)
        answer: Coroutine[None, None, web.StreamResponse]
        if stream:
            answer = self._stream(request, admitted, shape, include_usage, running_usage)
        else:
            answer = self._whole(admitted, shape)
        if admitted.caller.kind == "batch" and not stream:
            return await self._run_to_the_end(self._answer(admitted, answer))
        return await self._answer(admitted, answer)

    async def _answer(
        self, admitted: Admitted, answer: Coroutine[None, None, web.StreamResponse]
    ) -> web.StreamResponse:
        """`answer`, after which what the request holds is freed if it never ran (its client went away first)."""
        try:
            return await answer
        finally:
            self._pipeline.abandon(admitted)

    def _model_label(self, body: dict[str, Any]) -> str:
        """The body's model where it is one the registry holds (no label per unknown name), else ""."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self._pipeline.registry.models else ""

    async def _run_to_the_end(self, answer: Coroutine[None, None, web.StreamResponse]) -> web.StreamResponse:
        """A batch line runs to its end even when its runner goes away: its answer is then kept under the
        line's idempotency key, and the runner, started again, gets it back without running it twice."""
        task = asyncio.get_running_loop().create_task(answer)
        self._unattended.add(task)
        task.add_done_callback(self._unattended.discard)
        return await asyncio.shield(task)

    async def _whole(self, admitted: Admitted, shape: "Shape") -> web.Response:
        texts: dict[int, list[str]] = {}  # per choice
        lasts: dict[int, GenerationOutput] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        try:
            async with aclosing(self._pipeline.generate(admitted, whole=True)) as outputs:
                async for output in outputs:
                    texts.setdefault(output.index, []).append(output.text)
                    lasts[output.index] = output
                    logprobs.setdefault(output.index, []).extend(output.logprobs or ())
        except GatewayError as error:
            return execution_error(error, admitted)
        if not lasts:  # the pipeline ends every execution with an output or an error
            missing = GatewayError(ErrorKind.INTERNAL, "the generation ended without a response")
            return execution_error(missing, admitted)
        usage = next((last.usage for last in lasts.values() if last.usage is not None), None)
        parts = [("".join(texts[index]), lasts[index]) for index in sorted(lasts)]
        asked = logprobs if admitted.plan.sampling.logprobs else None
        return web.json_response(shape.whole(parts, usage, asked), headers=_response_headers(admitted))

    async def _stream(
        self, request: web.Request, admitted: Admitted, shape: "Shape", include_usage: bool, running_usage: bool
    ) -> web.StreamResponse:
        """Server-sent events, as `_Chunks` writes them."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_response_headers(admitted),
            }
        )
        await response.prepare(request)
        chunks = _Chunks(response, shape, include_usage, running_usage, len(admitted.plan.prompt_token_ids))
        try:
            if shape.chat:
                for index in range(admitted.plan.n):
                    await chunks.send(shape.chunk({"role": "assistant", "content": ""}, None, include_usage, index))
            async with aclosing(self._pipeline.generate(admitted)) as outputs:
                async for output in outputs:
                    await chunks.send_output(output)
        except GatewayError as error:
            await send_event(response, {"error": error_body(as_told(error, admitted.execution_id))})
        except ConnectionError:  # the client went away: leaving the pipeline cancelled the workers' calls
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Chunks:
    """The chunks of one stream; with `running_usage` (stream_options.continuous_usage_stats) every chunk
    carries the usage so far: the prompt, and the output tokens of every choice sent until then."""

    def __init__(
        self, response: web.StreamResponse, shape: "Shape", include_usage: bool, running_usage: bool, prompt: int
    ) -> None:
        self._response, self._shape = response, shape
        self._include_usage, self._running_usage = include_usage, running_usage
        self._prompt_tokens, self._sent_tokens = prompt, 0

    async def send_output(self, output: GenerationOutput) -> None:
        shape, include_usage = self._shape, self._include_usage
        self._sent_tokens += len(output.token_ids)
        if output.tool_calls:
            calls = {"tool_calls": tool_call_deltas(output.tool_calls)}
            await self.send(shape.chunk(calls, None, include_usage, output.index))
        if output.text or output.finish_reason or output.logprobs:
            await self.send(
                shape.chunk(output.text, output.finish_reason, include_usage, output.index, output.logprobs)
            )
        if output.usage is not None and include_usage:
            await send_event(self._response, shape.usage_chunk(output.usage))

    async def send(self, chunk: dict[str, Any]) -> None:
        if self._running_usage:
            chunk["usage"] = {
                "prompt_tokens": self._prompt_tokens,
                "completion_tokens": self._sent_tokens,
                "total_tokens": self._prompt_tokens + self._sent_tokens,
            }
        await send_event(self._response, chunk)


async def _name_answer(_request: web.Request, response: web.StreamResponse) -> None:
    name_answer(response)


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request)
    try:
        return await read_body_off_loop(raw, KNOWN_PARAMS)
    except JsonRefused as error:
        raise HttpError(error.message, error.param) from None


def _param_of(refused: HttpError | BodyRefused) -> str | None:
    return refused.param if isinstance(refused, HttpError) else None


def _authorization(request: web.Request) -> str | None:
    """The Authorization header; a non-ASCII one cannot hold an API key."""
    value = request.headers.get("Authorization")
    if value is not None and not _printable_ascii(value):
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            "the Authorization header holds characters that are not printable ASCII; send 'Bearer <api key>'",
        )
    return value


def _idempotency_key(request: web.Request) -> str:
    value = request.headers.get("Idempotency-Key", "")
    if not _printable_ascii(value):
        raise HttpError(
            "the Idempotency-Key header holds characters that are not printable ASCII; send a printable ASCII key",
            "idempotency_key",
        )
    return value


def _printable_ascii(value: str) -> bool:
    return value.isascii() and value.isprintable()


def _response_headers(admitted: Admitted) -> dict[str, str]:
    """The gRPC API's initial metadata as headers; the rate-limit names are the same in both."""
    names = {"request-id": REQUEST_ID_HEADER, "idempotent-replayed": "Idempotent-Replayed"}
    return {names.get(key, key): value for key, value in admitted.response_metadata}
