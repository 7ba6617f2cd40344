"""Anthropic's message object: its id, content blocks (text, then the tool_use calls), stop reason and
stop sequence, from the pipeline's outputs.

The pipeline ends an answer with finish reason `stop` both at the end-of-sequence token and at a stop
string, whose text it never sends. Which one it was is read back here: the output's tokens, decoded whole,
continue the text sent with the stop sequence they stopped at.
"""

import json
from typing import Any

from gateway.types import FinishReason, GenerationOutput, Tokenizer, ToolCall

MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"


def message_id(execution_id: str) -> str:
    """The message is named by its execution (`exec_<hex>` -> `msg_<hex>`), the usage ledger's key."""
    return MESSAGE_ID_PREFIX + execution_id.removeprefix("exec_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    use_id = TOOL_USE_ID_PREFIX + call.id.removeprefix("call_")
    return {"type": "tool_use", "id": use_id, "name": call.name, "input": json.loads(call.arguments)}


def content_blocks(text: str, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return blocks + [tool_use_block(call) for call in calls]


def stop_reason(
    last: GenerationOutput, text: str, token_ids: list[int], stop: list[str], tokenizer: Tokenizer
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer whose text is `text`, its tokens `token_ids`, its last output
    `last`."""
    if last.tool_calls:
        return "tool_use", None
    if last.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if last.finish_reason is FinishReason.INTERRUPTED:  # a replay of what an execution cut short handed over
        return "pause_turn", None
    matched = matched_stop(text, token_ids, stop, tokenizer) if stop else None
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def matched_stop(text: str, token_ids: list[int], stop: list[str], tokenizer: Tokenizer) -> str | None:
    """The stop sequence the tokens' text holds right after `text`, the text sent (None: it ended otherwise)."""
    decoded = tokenizer.decode(token_ids, skip_special_tokens=True)
    if not isinstance(decoded, str) or not decoded.startswith(text):  # one sequence of ids decodes to a str
        return None
    rest = decoded[len(text) :]
    return next((sequence for sequence in stop if rest.startswith(sequence)), None)


def message_json(
    execution_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, Any],
) -> dict[str, Any]:
    reason, sequence = stop
    return {
        "id": message_id(execution_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }
