"""The items of a response, in OpenAI's Responses shapes: the input as the client sends it, read into items
with ids (what `GET /v1/responses/{id}/input_items` lists), those items as the chat messages a chat template
renders, and the output (a message of output_text, function calls) made from the pipeline's outputs.

An input item is a message (role user, assistant, system or developer; its content a string or a list of
input_text / output_text parts), a `function_call` the model made earlier, or the `function_call_output` that
answers one. Consecutive function calls after an assistant's message belong to that assistant's turn.
"""

import uuid
from typing import Any

from gateway.openai_api.tools import BadParam
from gateway.types import ChatMessage, ToolCall

MAX_INPUT_ITEMS = 2048
MAX_CONTENT_PARTS = 1024
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text", "output_text"}
NOT_TEXT_PARTS = {"input_image", "input_file", "input_audio", "refusal"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: object) -> list[dict[str, Any]]:
    """The request's `input` (a string: one user message) as items with ids; BadParam naming `input`."""
    if isinstance(value, str):
        return [_message_item("user", [value])]
    if not isinstance(value, list) or not value:
        raise BadParam("input is required: a string, or a non-empty list of items (messages, function calls)", "input")
    return [_item(item, index) for index, item in enumerate(value)]


def _item(item: object, index: int) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise BadParam(
            f"input[{index}] must be an object: a message, a function_call or a function_call_output", "input"
        )
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item, index)
    if kind == "function_call":
        fields = _strings(item, index, ("call_id", "name", "arguments"))
        return {
            "id": _given_id(item, index) or new_item_id("fc"),
            "type": "function_call",
            "status": "completed",
            **fields,
        }
    if kind == "function_call_output":
        call_id = _strings(item, index, ("call_id",))["call_id"]
        return {
            "id": _given_id(item, index) or new_item_id("fco"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": _output_text(item.get("output"), index),
            "status": "completed",
        }
    shown = kind if isinstance(kind, str) and len(kind) <= 40 else "unknown"
    raise BadParam(
        f"input[{index}] is of type {shown!r}; only message, function_call and function_call_output items are taken "
        "here (no stored item references, reasoning or built-in tool items)",
        "input",
    )


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise BadParam(f"input[{index}].role must be one of {', '.join(MESSAGE_ROLES)}", "input")
    content = item.get("content")
    if isinstance(content, str):
        return _message_item(role, [content])
    if not isinstance(content, list):
        raise BadParam(f"input[{index}].content must be a string or a list of input_text parts", "input")
    if len(content) > MAX_CONTENT_PARTS:
        raise BadParam(f"input[{index}].content holds {len(content)} parts; send at most {MAX_CONTENT_PARTS}", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NOT_TEXT_PARTS:
            raise BadParam(f"input[{index}].content holds a {kind} part; this platform takes text only", "input")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadParam(
                f'input[{index}].content may hold only text parts: {{"type": "input_text", "text": ...}}', "input"
            )
        texts.append(part["text"])
    return _message_item(role, texts)


def _message_item(role: str, texts: list[str]) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    parts = [{"type": kind, "text": text, **({"annotations": []} if role == "assistant" else {})} for text in texts]
    return {"id": new_item_id("msg"), "type": "message", "role": role, "status": "completed", "content": parts}


def _strings(item: dict[str, Any], index: int, names: tuple[str, ...]) -> dict[str, str]:
    strings = {name: value for name in names if isinstance(value := item.get(name), str)}
    missing = [name for name in names if name not in strings]
    if missing:
        raise BadParam(f"input[{index}] ({item.get('type')}) needs {missing[0]} as a string", "input")
    return strings


def _given_id(item: dict[str, Any], index: int) -> str | None:
    given = item.get("id")
    if given is None:
        return None
    if not isinstance(given, str) or not 0 < len(given) <= 64 or not all("!" <= c <= "~" for c in given):
        raise BadParam(f"input[{index}].id must be 1 to 64 printable ASCII characters, no spaces", "input")
    return given


def _output_text(output: object, index: int) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str) for p in output
    ):
        return "".join(p["text"] for p in output)
    raise BadParam(f"input[{index}].output must be a string or a list of input_text parts", "input")


def item_text(item: dict[str, Any]) -> str:
    """The text of a message item's parts."""
    return "".join(part.get("text", "") for part in item.get("content", ()))


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[ChatMessage]:
    """The items as chat messages: the instructions first (a system message), function calls in the assistant
    turn they follow, function call outputs as tool messages."""
    messages = [ChatMessage("system", instructions)] if instructions is not None else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append(ChatMessage(item["role"], item_text(item)))
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not last.tool_call_id:
                messages[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", "", (call,)))
        elif kind == "function_call_output":
            messages.append(ChatMessage("tool", item["output"], tool_call_id=item["call_id"]))
    return messages


def output_items(
    message_id: str, text: str, calls: tuple[ToolCall, ...], call_item_ids: list[str], status: str
) -> list[dict[str, Any]]:
    """The output: the message (unless the answer is calls alone), then each call as a function_call item."""
    items = []
    if text or not calls:
        items.append(output_message(message_id, text, status))
    items += [
        function_call_item(item_id, call, "completed") for item_id, call in zip(call_item_ids, calls, strict=True)
    ]
    return items


def output_message(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text)] if status != "in_progress" else [],
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
    }
