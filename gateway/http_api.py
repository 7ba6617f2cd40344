"""The OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`,
with server-sent-event streaming. It translates each request into the public GenerateRequest and runs
it through the same pipeline as the gRPC API (same routing, limits and metering), then translates the
pipeline's output back into OpenAI's shapes. It runs in the gateway's event loop, next to grpc.aio.
"""

import json
import logging
import math
import time
from contextlib import aclosing

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from diptych._proto.v1 import inference_pb2
from gateway.errors import GatewayError
from gateway.pipeline import Pipeline

log = logging.getLogger(__name__)

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
PRIORITIES = {"interactive": inference_pb2.PRIORITY_INTERACTIVE, "batch": inference_pb2.PRIORITY_BATCH}
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_PARAMS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
           "priority", "idempotency_key", "prompt_token_ids", "request_id", "chat", "stream_options")
_FINISH = {inference_pb2.FINISH_REASON_STOP: "stop", inference_pb2.FINISH_REASON_LENGTH: "length"}


class HttpError(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def build_app(pipeline: Pipeline) -> web.Application:
    api = OpenAiApi(pipeline)
    app = web.Application(client_max_size=8 << 20)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)   # also on --metrics-port; here too for benchmark tools
    return app


class OpenAiApi:
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def health(self, request: web.Request) -> web.Response:
        if self._pipeline.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        try:
            await self._pipeline.auth.authenticate_header(request.headers.get("Authorization"))
        except GatewayError as error:
            return _error_response(error)
        return web.json_response({"object": "list", "data": [_model(name) for name in sorted(self._pipeline.registry.models)]})

    async def model(self, request: web.Request) -> web.Response:
        try:
            await self._pipeline.auth.authenticate_header(request.headers.get("Authorization"))
        except GatewayError as error:
            return _error_response(error)
        name = request.match_info["model"]
        if name not in self._pipeline.registry.models:
            return _error_response(GatewayError(grpc.StatusCode.NOT_FOUND, f"model '{name}' does not exist"))
        return web.json_response(_model(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            generate_request = _to_generate_request(body, chat, request.headers.get("Idempotency-Key", ""))
            stream = _flag(body, "stream")
            include_usage = stream and _include_usage(body)
            admitted = await self._pipeline.admit(request.headers.get("Authorization"), generate_request, "http")
        except HttpError as error:
            return _json_error(400, "invalid_request_error", error.message, error.param)
        except GatewayError as error:
            return _error_response(error)
        shape = _Shape(admitted.plan.request_id, generate_request.model, chat)
        if stream:
            return await self._stream(request, admitted, shape, include_usage)
        texts, last = [], None
        try:
            async with aclosing(self._pipeline.generate(admitted)) as responses:
                async for response in responses:
                    texts.append(response.text)
                    last = response
        except GatewayError as error:
            return _error_response(error)
        return web.json_response(shape.whole("".join(texts), last), headers={"X-Request-Id": shape.request_id})

    async def _stream(self, request, admitted, shape: "_Shape", include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": shape.request_id,
        })
        await response.prepare(request)
        try:
            if shape.chat:
                await _send(response, shape.chunk({"role": "assistant", "content": ""}, None, include_usage))
            async with aclosing(self._pipeline.generate(admitted)) as responses:
                async for message in responses:
                    finish = _FINISH.get(message.finish_reason)
                    if message.text or finish:
                        await _send(response, shape.chunk(message.text, finish, include_usage))
                    if finish and include_usage:
                        await _send(response, shape.usage_chunk(message.usage))
        except GatewayError as error:
            await _send(response, {"error": _error_body(error)})
        except ConnectionError:   # the client went away: leaving the pipeline cancelled the workers' calls
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Shape:
    """OpenAI's response shapes for one request."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def whole(self, text: str, last: inference_pb2.GenerateResponse) -> dict:
        finish = _FINISH.get(last.finish_reason, "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._head(stream=False), "choices": [choice], "usage": _usage(last.usage)}

    def chunk(self, delta, finish: str | None, include_usage: bool) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        chunk = {**self._head(stream=True), "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: inference_pb2.Usage) -> dict:
        return {**self._head(stream=True), "choices": [], "usage": _usage(usage)}

    def _head(self, stream: bool) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def _usage(usage: inference_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "diptych"}


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HttpError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HttpError("the request body must be a JSON object")
    return body


def _to_generate_request(body: dict, chat: bool, idempotency_key: str) -> inference_pb2.GenerateRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError("model is required: the name of a model from GET /v1/models", "model")
    request = inference_pb2.GenerateRequest(model=model, idempotency_key=idempotency_key)
    if chat:
        request.chat.CopyFrom(_chat(body.get("messages")))
    else:
        _set_prompt(request, body.get("prompt"))
    _refuse_unsupported(body)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        request.max_tokens = _integer(max_tokens, "max_tokens", 0, UINT32_MAX)
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            setattr(request, name, _number(body[name], name))
    if body.get("top_k") is not None:
        request.top_k = _integer(body["top_k"], "top_k", 0, UINT32_MAX)
    if body.get("seed") is not None:
        request.seed = _integer(body["seed"], "seed", 0, UINT64_MAX)
    request.stop.extend(_stop(body.get("stop")))
    if body.get("ignore_eos") is not None:
        request.ignore_eos = _flag(body, "ignore_eos")
    priority = body.get("priority", "interactive")
    if priority not in PRIORITIES:
        raise HttpError(f"priority must be one of {', '.join(PRIORITIES)}", "priority")
    request.priority = PRIORITIES[priority]
    return request


def _set_prompt(request: inference_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t <= UINT32_MAX for t in prompt):
            raise HttpError("prompt token ids must be non-negative integers", "prompt")
        request.prompt_token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise HttpError("send one prompt per request; batches of prompts are not supported", "prompt")
    else:
        raise HttpError("prompt is required: a string or a list of token ids", "prompt")


def _chat(messages) -> inference_pb2.ChatMessages:
    if not isinstance(messages, list) or not messages:
        raise HttpError("messages must be a non-empty list of {role, content} objects", "messages")
    chat = inference_pb2.ChatMessages()
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise HttpError(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise HttpError(f"messages[{index}].role is {role!r}; use one of {', '.join(CHAT_ROLES)}", "messages")
        chat.messages.add(role=CHAT_ROLES[role], content=_content(message.get("content"), index))
    return chat


def _content(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HttpError(f"messages[{index}].content may hold only text parts", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise HttpError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _refuse_unsupported(body: dict) -> None:
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise HttpError("n and best_of must be 1: one completion per request", "n")
    if body.get("echo"):
        raise HttpError("echo is not supported", "echo")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise HttpError("logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise HttpError(f"{name} is not supported; leave it at 0", name)
    if body.get("tools") or body.get("functions"):
        raise HttpError("tools are not supported", "tools")


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


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError("stream_options must be an object", "stream_options")
    return _flag(options, "include_usage")


def _error_body(error: GatewayError) -> dict:
    _, kind = _STATUS.get(error.code, (500, "server_error"))
    first_word = error.message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
    code = None
    if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        code = "insufficient_quota" if error.message.startswith("spend limit") else "rate_limit_exceeded"
    elif error.code is grpc.StatusCode.NOT_FOUND:
        code = "model_not_found"
    elif error.code is grpc.StatusCode.UNAUTHENTICATED:
        code = "invalid_api_key"
    return {"message": error.message, "type": kind, "param": first_word if first_word in _PARAMS else None, "code": code}


def _error_response(error: GatewayError) -> web.Response:
    status, _ = _STATUS.get(error.code, (500, "server_error"))
    headers = {}
    if error.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(error.retry_after_ms)
    return web.json_response({"error": _error_body(error)}, status=status, headers=headers)


def _json_error(status: int, kind: str, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)
