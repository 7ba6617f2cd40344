"""The Response object, OpenAI's shape of a response, made from a `ResponseRecord` (what the gateway runs and
the control plane stores), and what a running response has produced so far (`ProducedOutput`)."""

import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.openai_api.responses_items import new_item_id, output_items
from gateway.types import FinishReason, GenerationOutput, ToolCall, Usage

Value = TypeVar("Value")

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class ProducedOutput:
    """A response's output as the pipeline hands it over: its text, its token ids (as generated: the next
    turn's prompt starts with them), the calls it made, how it ended and its usage."""

    message_id: str = field(default_factory=lambda: new_item_id("msg"))
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tool_calls: tuple[ToolCall, ...] = ()
    call_item_ids: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    def push(self, output: GenerationOutput) -> None:
        self.text.append(output.text)
        self.token_ids.extend(output.token_ids)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.tool_calls = output.tool_calls
            self.call_item_ids = [new_item_id("fc") for _ in output.tool_calls]
        if output.usage is not None:
            self.usage = output.usage

    @property
    def status(self) -> str:
        """completed, or incomplete when max_output_tokens (or the context) cut it."""
        return "incomplete" if self.finish_reason is FinishReason.LENGTH else "completed"

    def items(self, status: str | None = None) -> list[dict[str, Any]]:
        status = status or self.status
        return output_items(self.message_id, "".join(self.text), self.tool_calls, self.call_item_ids, status)


@dataclass
class ResponseRecord:
    """A response as the gateway runs it and the control plane stores it."""

    id: str
    organization_id: str
    api_key_id: str
    model: str
    request: dict[str, Any]  # the request's options, echoed (ResponsesRequest.echoed)
    metadata: dict[str, str]
    context_items: list[dict[str, Any]]  # the conversation before this response's input (its previous responses')
    input_items: list[dict[str, Any]]
    prompt_token_ids: list[int]
    status: str = "in_progress"
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    output_items: list[dict[str, Any]] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None

    def ended(self, produced: ProducedOutput) -> None:
        """The record of a response whose generation ended (completed, or incomplete)."""
        self.finish(produced.status, produced)
        if produced.status == "incomplete":
            self.incomplete_details = {"reason": "max_output_tokens"}

    def finish(self, status: str, produced: ProducedOutput, error: dict[str, Any] | None = None) -> None:
        self.status = status
        self.output_items = produced.items("incomplete" if status in ("cancelled", "failed") else None)
        self.output_token_ids = list(produced.token_ids)
        self.usage = usage_json(produced.usage) if produced.usage is not None else None
        self.error = error
        if status == "completed":
            self.completed_at = int(time.time())


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # No cache writes are priced here: every computed full block is kept, at no charge.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_json(record: ResponseRecord) -> dict[str, Any]:
    """OpenAI's Response object."""
    request = record.request
    return {
        "id": record.id,
        "object": "response",
        "created_at": record.created_at,
        "status": record.status,
        "background": request.get("background", False),
        "completed_at": record.completed_at,
        "error": record.error,
        "incomplete_details": record.incomplete_details,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": record.model,
        "output": record.output_items,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": request.get("previous_response_id"),
        "prompt_cache_key": request.get("prompt_cache_key") or None,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": None,
        "service_tier": "default",
        "store": request.get("store", True),
        "temperature": _or(request.get("temperature"), 1.0),
        "text": request.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "top_logprobs": 0,
        "top_p": _or(request.get("top_p"), 1.0),
        "truncation": request.get("truncation") or "disabled",
        "usage": record.usage,
        "user": request.get("user") or None,
        "metadata": record.metadata,
    }


def _or(value: Value | None, default: Value) -> Value:
    return default if value is None else value


def error_object(code: str, message: str) -> dict[str, Any]:
    """A failed response's `error`: OpenAI's codes say server_error or rate_limit_exceeded for what fails here."""
    return {"code": code, "message": message}
