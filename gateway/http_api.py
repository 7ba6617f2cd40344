"""The OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`,
with server-sent-event streaming. It maps each request into the gateway's GenerationRequest and runs it
through the same pipeline as the gRPC API (same routing, limits and metering), then maps the pipeline's
outputs and errors into OpenAI's shapes. It runs in the gateway's event loop, next to grpc.aio.
"""

import asyncio
import json
import logging
import math
import time
from collections.abc import Coroutine
from contextlib import aclosing

from aiohttp import web

from gateway import openai_params
from gateway.batch_api import BatchApiProxy
from gateway.http_server import REQUEST_ID_HEADER, name_answer
from gateway.json_body import JsonRefused, read_body_off_loop, start_parsers
from gateway.logprobs import CompletionLogprobs, chat_logprobs
from gateway.openai_tools import BadParam, message_tool_fields, structured_fields, tool_call_deltas, tool_calls_json
from gateway.pipeline import Admitted, Pipeline
from gateway.registry import ModelInfo
from gateway.types import (
    ChatMessage,
    ErrorKind,
    GatewayError,
    GenerationOutput,
    GenerationRequest,
    Priority,
    TokenLogprob,
    Usage,
    as_float32,
)
from gateway.validation import CHAT_ROLES, MAX_CHOICES, MAX_TOP_LOGPROBS, check_counts, is_client_label

log = logging.getLogger(__name__)

# Bounds the body before it is parsed: twice the longest prompt any model takes (validation.py's
# MAX_PROMPT_BYTES), for JSON's escapes and the rest of the body.
MAX_BODY_BYTES = 8 << 20
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_CONTENT_PARTS = 1024  # text parts of one message
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: the most likely tokens per token, as OpenAI's
PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
_STATUS = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.ABORTED: (409, "conflict_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout"),
}
_PARAMS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "priority",
    "idempotency_key",
    "prompt_token_ids",
    "request_id",
    "chat",
    "stream_options",
    "prompt_cache_key",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
KNOWN_PARAMS = frozenset(_PARAMS) | frozenset(openai_params.EVERY)  # named in the errors of the body's JSON


class HttpError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def build_app(pipeline: Pipeline, batch_api: BatchApiProxy | None = None) -> web.Application:
    """`batch_api` serves /v1/files and /v1/batches (the control plane keeps them)."""
    api = OpenAiApi(pipeline)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    app.on_startup.append(start_parsers)
    app.on_response_prepare.append(_name_answer)
    if batch_api is not None:
        batch_api.add_routes(app)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/health", api.health)
    # No /metrics here: this port is public, and metrics name models, workers and volumes. Prometheus and
    # benchmark tools scrape the gateway's --metrics-port, on the private network.
    return app


class OpenAiApi:
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self._unattended: set[asyncio.Task] = set()  # batch lines whose runner went away

    async def health(self, request: web.Request) -> web.Response:
        if self._pipeline.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        try:
            _, limits = await self._pipeline.authenticate(_authorization(request), request.remote or "")
        except GatewayError as error:
            return _error_response(error)
        registry = self._pipeline.registry.models
        models = [_model(registry[name]) for name in sorted(registry)]
        return web.json_response({"object": "list", "data": models}, headers=dict(limits))

    async def model(self, request: web.Request) -> web.Response:
        try:
            _, limits = await self._pipeline.authenticate(_authorization(request), request.remote or "")
        except GatewayError as error:
            return _error_response(error)
        name = request.match_info["model"]
        if name not in self._pipeline.registry.models:
            missing = GatewayError(ErrorKind.NOT_FOUND, f"model '{name}' does not exist")
            missing.rate_limit_metadata = limits
            return _error_response(missing)
        return web.json_response(_model(self._pipeline.registry.models[name]), headers=dict(limits))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            generation_request = _to_generation_request(body, chat, _idempotency_key(request))
            stream = _flag(body, "stream")
            include_usage, running_usage = _stream_options(body)
            admitted = await self._pipeline.admit(
                _authorization(request), generation_request, "http", request.remote or ""
            )
        except HttpError as error:
            return _json_error(error.status, "invalid_request_error", error.message, error.param)
        except GatewayError as error:
            return _error_response(error)
        shape = _Shape(admitted.execution_id, generation_request.model, chat, admitted.plan.tokenizer)
        if stream:
            return await self._stream(request, admitted, shape, include_usage, running_usage)
        if admitted.caller.kind == "batch":
            return await self._run_to_the_end(self._whole(admitted, shape))
        return await self._whole(admitted, shape)

    async def _run_to_the_end(self, answer: Coroutine[None, None, web.Response]) -> web.Response:
        """A batch line runs to its end even when its runner goes away: its answer is then kept under the
        line's idempotency key, and the runner, started again, gets it back without running it twice."""
        task = asyncio.get_running_loop().create_task(answer)
        self._unattended.add(task)
        task.add_done_callback(self._unattended.discard)
        return await asyncio.shield(task)

    async def _whole(self, admitted: Admitted, shape: "_Shape") -> web.Response:
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
            return _execution_error(error, admitted)
        if not lasts:  # the pipeline ends every execution with an output or an error
            missing = GatewayError(ErrorKind.INTERNAL, "the generation ended without a response")
            return _execution_error(missing, admitted)
        usage = next((last.usage for last in lasts.values() if last.usage is not None), None)
        parts = [("".join(texts[index]), lasts[index]) for index in sorted(lasts)]
        asked = logprobs if admitted.plan.sampling.logprobs else None
        return web.json_response(shape.whole(parts, usage, asked), headers=_response_headers(admitted))

    async def _stream(
        self, request, admitted, shape: "_Shape", include_usage: bool, running_usage: bool
    ) -> web.StreamResponse:
        """Server-sent events; with `running_usage` (stream_options.continuous_usage_stats) every chunk
        carries the usage so far: the prompt, and the output tokens of every choice sent until then."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_response_headers(admitted),
            }
        )
        await response.prepare(request)
        prompt_tokens, sent_tokens = len(admitted.plan.prompt_token_ids), 0

        async def send(chunk: dict) -> None:
            if running_usage:
                total = prompt_tokens + sent_tokens
                chunk["usage"] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": sent_tokens,
                    "total_tokens": total,
                }
            await _send(response, chunk)

        try:
            if shape.chat:
                for index in range(admitted.plan.n):
                    role = {"role": "assistant", "content": ""}
                    await send(shape.chunk(role, None, include_usage, index))
            async with aclosing(self._pipeline.generate(admitted)) as outputs:
                async for output in outputs:
                    sent_tokens += len(output.token_ids)
                    finish = output.finish_reason
                    if output.tool_calls:
                        calls = {"tool_calls": tool_call_deltas(output.tool_calls)}
                        await send(shape.chunk(calls, None, include_usage, output.index))
                    if output.text or finish or output.logprobs:
                        await send(shape.chunk(output.text, finish, include_usage, output.index, output.logprobs))
                    if output.usage is not None and include_usage:
                        await _send(response, shape.usage_chunk(output.usage))
        except GatewayError as error:
            await _send(response, {"error": _error_body(error)})
        except ConnectionError:  # the client went away: leaving the pipeline cancelled the workers' calls
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Shape:
    """OpenAI's response shapes for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer=None) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._tokenizer = tokenizer  # the model's: the bytes of the tokens in logprobs
        self._completion_logprobs: dict[int, CompletionLogprobs] = {}  # per choice

    def whole(
        self,
        parts: list[tuple[str, GenerationOutput]],
        usage: Usage | None,
        logprobs: dict[int, list[TokenLogprob]] | None = None,
    ) -> dict:
        """The answer: per choice, its whole text and its last output (and its tokens' logprobs, when the
        request asked for them)."""
        choices = [self._whole_choice(text, last, logprobs) for text, last in parts]
        return {**self._head(stream=False), "choices": choices, "usage": _usage(usage)}

    def _whole_choice(self, text: str, last: GenerationOutput, logprobs: dict[int, list] | None) -> dict:
        finish = last.finish_reason or "stop"
        shaped = self._logprobs(last.index, logprobs.get(last.index, [])) if logprobs is not None else None
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if last.tool_calls:
                message.update(content=text or None, tool_calls=tool_calls_json(last.tool_calls))
            return {"index": last.index, "message": message, "finish_reason": finish, "logprobs": shaped}
        return {"index": last.index, "text": text, "finish_reason": finish, "logprobs": shaped}

    def chunk(
        self, delta, finish: str | None, include_usage: bool, index: int = 0, logprobs: list | None = None
    ) -> dict:
        shaped = self._logprobs(index, logprobs) if logprobs else None
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": content, "finish_reason": finish, "logprobs": shaped}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": shaped}
        chunk = {**self._head(stream=True), "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict:
        if self.chat:
            return chat_logprobs(self._tokenizer, logprobs)
        return self._completion_logprobs.setdefault(index, CompletionLogprobs()).shape(logprobs)

    def usage_chunk(self, usage: Usage | None) -> dict:
        return {**self._head(stream=True), "choices": [], "usage": _usage(usage)}

    def _head(self, stream: bool) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def _usage(usage: Usage | None) -> dict | None:
    """None where the output carries no usage, as the gRPC API leaves it out."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _model(model: ModelInfo) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "diptych"}


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _name_answer(request: web.Request, response: web.StreamResponse) -> None:
    name_answer(response)


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error answer has OpenAI's JSON shape: aiohttp's own (unknown path, wrong method) too, and a
    defect of ours is a JSON 500 rather than a text page."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _json_error(error.status, "invalid_request_error", error.reason, None)
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return _json_error(500, "server_error", "the gateway failed to answer this request; retry it", None)


async def _json_body(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(
            f"the request body is larger than {MAX_BODY_BYTES} bytes; send a shorter prompt", status=413
        ) from None
    try:
        return await read_body_off_loop(raw, KNOWN_PARAMS)
    except JsonRefused as error:
        raise HttpError(error.message, error.param) from None


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


def _to_generation_request(body: dict, chat: bool, idempotency_key: str) -> GenerationRequest:
    model = body.get("model")
    if model is None or model == "":
        raise HttpError("model is required: the name of a model from GET /v1/models", "model")
    if not isinstance(model, str):
        raise HttpError("model must be a string: the name of a model from GET /v1/models", "model")
    check_counts(*(_length(body.get(name)) for name in ("stop", "logit_bias", "tools")))
    fields = {"chat": _chat(body.get("messages"))} if chat else _prompt(body.get("prompt"))
    refused = openai_params.refusal(body, chat)
    if refused is not None:
        raise HttpError(refused.message, refused.param)
    try:
        fields.update(structured_fields(body))
    except BadParam as error:
        raise HttpError(error.message, error.param) from None
    max_tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(max_tokens_name) is not None:
        fields["max_tokens"] = _integer(body[max_tokens_name], max_tokens_name, 0, UINT32_MAX)
    fields.update(_choices_and_session(body))
    fields.update(_sampling_controls(body, chat))
    for name in ("temperature", "top_p"):  # at float32 precision, as the gRPC API carries them
        if body.get(name) is not None:
            fields[name] = as_float32(_number(body[name], name))
    if body.get("top_k") is not None:
        fields["top_k"] = _integer(body["top_k"], "top_k", 0, UINT32_MAX)
    if body.get("seed") is not None:
        fields["seed"] = _integer(body["seed"], "seed", 0, UINT64_MAX)
    fields["stop"] = _stop(body.get("stop"))
    if body.get("ignore_eos") is not None:
        fields["ignore_eos"] = _flag(body, "ignore_eos")
    priority = body.get("priority", "interactive")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise HttpError(f"priority must be one of {', '.join(PRIORITIES)}", "priority")
    return GenerationRequest(model=model, idempotency_key=idempotency_key, priority=PRIORITIES[priority], **fields)


def _length(value) -> int:
    """How many entries a list or object holds (0 for anything else: its type is checked where it is read)."""
    return len(value) if isinstance(value, (list, dict)) else 0


def _prompt(prompt) -> dict:
    """The completion's input: {"prompt": text} or {"prompt_token_ids": ids}."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t <= UINT32_MAX for t in prompt):
            raise HttpError("prompt token ids must be non-negative integers", "prompt")
        return {"prompt_token_ids": list(prompt)}
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise HttpError("send one prompt per request; batches of prompts are not supported", "prompt")
    raise HttpError("prompt is required: a string or a list of token ids", "prompt")


def _chat(messages) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise HttpError("messages must be a non-empty list of {role, content} objects", "messages")
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise HttpError(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise HttpError(f"messages[{index}].role is {_shown(role)}; use one of {', '.join(CHAT_ROLES)}", "messages")
        try:
            tool_fields = message_tool_fields(message, index)
        except BadParam as error:
            raise HttpError(error.message, error.param) from None
        content = message.get("content")
        if content is None and tool_fields.get("tool_calls"):  # an assistant's turn of calls alone
            content = ""
        chat.append(ChatMessage(role, _content(content, index), **tool_fields))
    return chat


def _content(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise HttpError(
                f"messages[{index}].content holds {len(content)} parts; send at most {MAX_CONTENT_PARTS} "
                "(join the text into fewer parts)",
                "messages",
            )
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HttpError(f"messages[{index}].content may hold only text parts", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise HttpError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _choices_and_session(body: dict) -> dict:
    """n, prompt_cache_key, and user (kept as the request's label in usage)."""
    fields: dict = {}
    if body.get("n") is not None:
        fields["n"] = _integer(body["n"], "n", 1, MAX_CHOICES)
    key = body.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str):
            raise HttpError(
                "prompt_cache_key must be a string naming the session whose prompts share a prefix",
                "prompt_cache_key",
            )
        fields["prompt_cache_key"] = key
    user = body.get("user")
    if user not in (None, ""):
        if not isinstance(user, str) or not is_client_label(user):
            raise HttpError(
                "user must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-' (it labels the "
                "request in usage); send a hashed id",
                "user",
            )
        fields["client_request_id"] = user
    return fields


def _sampling_controls(body: dict, chat: bool) -> dict:
    """presence_penalty, frequency_penalty, logit_bias, logprobs and top_logprobs, in the gateway's types
    (their bounds are checked in validation.py, for both APIs)."""
    fields: dict = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            fields[name] = as_float32(_number(body[name], name))
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"]) or None
    if chat:
        fields["logprobs"] = _flag(body, "logprobs")
        if body.get("top_logprobs") is not None:
            fields["top_logprobs"] = _integer(body["top_logprobs"], "top_logprobs", 0, MAX_TOP_LOGPROBS)
    elif body.get("logprobs") is not None:  # completions: how many of the most likely tokens, 0 to 5
        fields["logprobs"] = True
        fields["top_logprobs"] = _integer(body["logprobs"], "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return fields


def _logit_bias(bias) -> dict[int, float]:
    """OpenAI's {"token id": bias} as {token id: bias}, the bias at float32 precision."""
    if not isinstance(bias, dict):
        raise HttpError('logit_bias must be an object mapping token ids to biases, e.g. {"50256": -100}', "logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise HttpError(f"logit_bias keys must be token ids written as integers, got {_shown(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HttpError(
                f"logit_bias values must be numbers from -100 to 100, got {_shown(value)} for token {key}",
                "logit_bias",
            )
        parsed[int(key)] = as_float32(float(value))
    return parsed


def _shown(value) -> str:
    """A client's value, short enough to quote in an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise HttpError("stop must be a string or a list of strings", "stop")


def _integer(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(f"{name} must be an integer from {low} to {high}", name)
    return value


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HttpError(f"{name} must be a number", name)
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError(f"{name} must be true or false", name)
    return value


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streamed request; openai_params refused any other key."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError("stream_options must be an object", "stream_options")
    return _flag(options, "include_usage"), _flag(options, "continuous_usage_stats")


def _error_body(error: GatewayError) -> dict:
    _, kind = _STATUS.get(error.kind, (500, "server_error"))
    first_word = error.message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
    code = None
    if error.kind is ErrorKind.RESOURCE_EXHAUSTED:
        code = "insufficient_quota" if error.message.startswith("spend limit") else "rate_limit_exceeded"
    elif error.kind is ErrorKind.NOT_FOUND:
        code = "model_not_found"
    elif error.kind is ErrorKind.UNAUTHENTICATED:
        code = "invalid_api_key"
    param = first_word if first_word in _PARAMS else None
    return {"message": error.message, "type": kind, "param": param, "code": code}


def _error_response(error: GatewayError) -> web.Response:
    status, _ = _STATUS.get(error.kind, (500, "server_error"))
    headers = dict(error.rate_limit_metadata)
    if error.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(error.retry_after_ms)
    return web.json_response({"error": _error_body(error)}, status=status, headers=headers)


def _execution_error(error: GatewayError, admitted: Admitted) -> web.Response:
    """The error that ended an execution, named by its id."""
    response = _error_response(error)
    response.headers[REQUEST_ID_HEADER] = admitted.execution_id
    return response


def _json_error(status: int, kind: str, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


def _response_headers(admitted: Admitted) -> dict[str, str]:
    """The gRPC API's initial metadata as headers; the rate-limit names are the same in both."""
    names = {"request-id": REQUEST_ID_HEADER, "idempotent-replayed": "Idempotent-Replayed"}
    return {names.get(key, key): value for key, value in admitted.response_metadata}
