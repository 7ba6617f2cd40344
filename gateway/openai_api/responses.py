"""OpenAI's response shapes: a whole answer, a streamed chunk and its server-sent event, usage, a model."""

import functools
import hashlib
import json
import time
from importlib import metadata
from typing import Any

from aiohttp import web

from gateway.core.logprobs import CompletionLogprobs, chat_logprobs
from gateway.fleet.registry import ModelInfo
from gateway.openai_api.tools import tool_calls_json
from gateway.types import GenerationOutput, Tokenizer, TokenLogprob, Usage

SERVED_TIER = "default"  # the one tier every request is served in ("auto" asks for it)


def _gateway_build() -> str:
    try:
        return metadata.version("diptych-server")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unversioned"


GATEWAY_BUILD = _gateway_build()


@functools.cache
def system_fingerprint(model: ModelInfo) -> str:
    """Names the backend an answer came from: the model, its weights' source and revision, and the gateway's
    build. It changes when one of them does, so a client comparing seeded answers knows when to expect a
    difference."""
    backend = "\0".join((model.name, model.source, model.revision, GATEWAY_BUILD))
    return "fp_" + hashlib.sha256(backend.encode()).hexdigest()[:10]


class Shape:
    """OpenAI's response shapes for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Tokenizer, fingerprint: str = "") -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.fingerprint = fingerprint
        self.created = int(time.time())
        self._tokenizer = tokenizer  # the model's: the bytes of the tokens in logprobs
        self._completion_logprobs: dict[int, CompletionLogprobs] = {}  # per choice

    def whole(
        self,
        parts: list[tuple[str, GenerationOutput]],
        usage: Usage | None,
        logprobs: dict[int, list[TokenLogprob]] | None = None,
    ) -> dict[str, Any]:
        """The answer: per choice, its whole text and its last output (and its tokens' logprobs, when the
        request asked for them)."""
        choices = [self._whole_choice(text, last, logprobs) for text, last in parts]
        return {**self._head(stream=False), "choices": choices, "usage": usage_json(usage)}

    def _whole_choice(
        self, text: str, last: GenerationOutput, logprobs: dict[int, list[TokenLogprob]] | None
    ) -> dict[str, Any]:
        finish = last.finish_reason or "stop"
        shaped = self._logprobs(last.index, logprobs.get(last.index, [])) if logprobs is not None else None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if last.tool_calls:
                message.update(content=text or None, tool_calls=tool_calls_json(last.tool_calls))
            return {"index": last.index, "message": message, "finish_reason": finish, "logprobs": shaped}
        return {"index": last.index, "text": text, "finish_reason": finish, "logprobs": shaped}

    def chunk(
        self,
        delta: str | dict[str, Any],
        finish: str | None,
        include_usage: bool,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
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

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(self._tokenizer, logprobs)
        return self._completion_logprobs.setdefault(index, CompletionLogprobs()).shape(logprobs)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        return {**self._head(stream=True), "choices": [], "usage": usage_json(usage)}

    def _head(self, stream: bool) -> dict[str, Any]:
        head = {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model}
        if self.chat:
            head["object"] = "chat.completion.chunk" if stream else "chat.completion"
            head["service_tier"] = SERVED_TIER
        head["system_fingerprint"] = self.fingerprint
        return head


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    """None where the output carries no usage, as the gRPC API leaves it out."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def model_json(model: ModelInfo) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "diptych"}


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
