"""Anthropic's conversation, `system` and `messages` with their content blocks, read into turns and checked
(text, tool_use and tool_result blocks; the order of turns; each tool_use answered by a tool_result), then
mapped onto the gateway's chat messages, which the model's chat template renders as it renders a chat
completion's.

Consecutive turns of one role are one turn, as Anthropic combines them. A user turn's tool_result blocks
become `tool` messages (with the tool_use id they answer), its text one `user` message; an assistant turn is
one message with its tool_use blocks as its tool calls; the text blocks of a turn are joined as a chat
message's text parts are. A tool_result with `is_error` reads "Error: " and its text: the chat template has
no other way to show the model a failed call.

The `cache_control` marks are found here too: the prompt's prefix up to the last of them is what
`cache.py` counts as written to the prefix cache.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.anthropic_api.params import BadRequest, shown
from gateway.types import ChatMessage, ToolCall

MAX_BLOCKS = 1024  # content blocks of one message, as the chat API's text parts
MAX_CACHE_MARKS = 4  # Anthropic's limit of cache_control breakpoints per request
TOOL_USE_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")
ERROR_PREFIX = "Error: "
ROLES = ("user", "assistant", "system")
CACHE_TTLS = ("5m", "1h")  # accepted as Anthropic's; the prefix cache keeps blocks by memory, not by time
_REFUSED_BLOCKS = {
    "image": "this platform's models read text only; send text blocks",
    "document": "this platform's models read text only; send the document's text in text blocks",
    "search_result": "search result blocks are not served; send their text in text blocks",
    "thinking": "no model here thinks before answering; remove thinking blocks",
    "redacted_thinking": "no model here thinks before answering; remove redacted_thinking blocks",
    "container_upload": "containers are not served; remove container_upload blocks",
}
_SERVER_TOOL_BLOCK = "server tools are not served; remove the blocks of their calls and results"


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ToolUse:
    id: str
    name: str
    arguments: str  # its input, as JSON text


@dataclass(frozen=True)
class ToolResult:
    tool_use_id: str
    text: str
    is_error: bool = False


Block = Text | ToolUse | ToolResult


@dataclass(frozen=True)
class Turn:
    role: str  # "system", "user" or "assistant"
    blocks: tuple[Block, ...]
    source: str  # where it starts in the request, for error messages: "system", "messages[3]"


@dataclass(frozen=True, order=True)
class CacheMark:
    """A cache_control breakpoint: after block `block` of turn `index`, or (not `in_turns`) after tool `index`.
    Marks order as the prompt does: the tools, then the turns."""

    in_turns: bool
    index: int
    block: int = 0


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    last_mark: CacheMark | None  # the last of its cache_control marks (the tools' given to `read`)


def read(system: object, messages: object, tool_marks: list[CacheMark], request_mark: bool) -> Conversation:
    """The conversation, checked. `tool_marks`: the tools' cache_control marks; `request_mark`: the
    request's own `cache_control`, which marks the last block of the last turn."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    turns: list[Turn] = []
    marks = list(tool_marks)
    system_blocks = _system_blocks(system) if system is not None else []
    if system_blocks:
        _append(turns, marks, "system", system_blocks, "system")
    for index, message in enumerate(messages):
        role, blocks = _message(message, f"messages[{index}]")
        _append(turns, marks, role, blocks, f"messages[{index}]")
    _check_order(turns)
    if request_mark:
        marks.append(CacheMark(True, len(turns) - 1, len(turns[-1].blocks) - 1))
    if len(marks) > MAX_CACHE_MARKS:
        raise BadRequest(f"the request holds {len(marks)} cache_control breakpoints; send at most {MAX_CACHE_MARKS}")
    return Conversation(tuple(turns), max(marks, default=None))


def chat_messages(turns: tuple[Turn, ...]) -> list[ChatMessage]:
    chat = []
    for turn in turns:
        texts = "".join(block.text for block in turn.blocks if isinstance(block, Text))
        if turn.role == "user":
            chat += [_tool_message(block) for block in turn.blocks if isinstance(block, ToolResult)]
            if any(isinstance(block, Text) for block in turn.blocks):
                chat.append(ChatMessage("user", texts))
        elif turn.role == "assistant":
            calls = tuple(ToolCall(b.id, b.name, b.arguments) for b in turn.blocks if isinstance(b, ToolUse))
            chat.append(ChatMessage("assistant", texts, tool_calls=calls))
        else:
            chat.append(ChatMessage("system", texts))
    return chat


def cut_after(turns: tuple[Turn, ...], mark: CacheMark) -> tuple[Turn, ...]:
    """The turns up to and including the block `mark` names (a mark in the tools keeps no turn)."""
    if not mark.in_turns:
        return ()
    last = turns[mark.index]
    return (*turns[: mark.index], Turn(last.role, last.blocks[: mark.block + 1], last.source))


def _tool_message(result: ToolResult) -> ChatMessage:
    text = ERROR_PREFIX + result.text if result.is_error else result.text
    return ChatMessage("tool", text, tool_call_id=result.tool_use_id)


def _append(
    turns: list[Turn], marks: list[CacheMark], role: str, blocks: list[tuple[Block, bool]], source: str
) -> None:
    """Adds a message's blocks (each with whether it carries a cache mark), to the last turn when it has
    the same role."""
    if turns and turns[-1].role == role:
        last = turns.pop()
        before, source = last.blocks, last.source
    else:
        before = ()
    index = len(turns)
    marks += [CacheMark(True, index, len(before) + i) for i, (_, marked) in enumerate(blocks) if marked]
    turns.append(Turn(role, before + tuple(block for block, _ in blocks), source))


def _system_blocks(system: object) -> list[tuple[Block, bool]]:
    if isinstance(system, str):
        return [(Text(system), False)] if system else []
    if isinstance(system, list):
        return [_text_block(block, f"system[{i}]") for i, block in enumerate(system)]
    raise BadRequest("system must be a string or a list of text blocks")


def _message(message: object, where: str) -> tuple[str, list[tuple[Block, bool]]]:
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with role and content")
    only(message, ("role", "content"), where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"{where}.role is {shown(role)}; use one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, str):
        if not content:
            raise BadRequest(f"{where}.content is empty; send the message's text")
        return role, [(Text(content), False)]
    if not isinstance(content, list) or not content:
        raise BadRequest(f"{where}.content must be a non-empty string or a non-empty list of content blocks")
    if len(content) > MAX_BLOCKS:
        raise BadRequest(f"{where}.content holds {len(content)} blocks; send at most {MAX_BLOCKS}")
    return role, [_block(block, role, f"{where}.content[{i}]") for i, block in enumerate(content)]


def _block(block: Any, role: str, where: str) -> tuple[Block, bool]:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        return _text_block(block, where)
    if kind == "tool_use" and role == "assistant":
        return _tool_use(block, where)
    if kind == "tool_result" and role == "user":
        return _tool_result(block, where)
    if kind in ("tool_use", "tool_result"):
        raise BadRequest(f"{where} is a {kind} block in a {role} message; only {_owner(kind)} messages hold them")
    if not isinstance(kind, str):
        raise BadRequest(f"{where} must be a content block object with a type")
    advice = _REFUSED_BLOCKS.get(kind, _SERVER_TOOL_BLOCK if _is_server_tool_block(kind) else None)
    if advice is None:
        raise BadRequest(f"{where} has type {shown(kind)}; send text, tool_use or tool_result blocks")
    raise BadRequest(f"{where} is a {kind} block: {advice}")


def _text_block(block: object, where: str) -> tuple[Text, bool]:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise BadRequest(f'{where} must be a text block {{"type": "text", "text": ...}}')
    only(block, ("type", "text", "cache_control", "citations"), where)
    text = block.get("text")
    if not isinstance(text, str) or not text:
        raise BadRequest(f"{where}.text must be a non-empty string")
    if block.get("citations") not in (None, []):
        raise BadRequest(f"{where}.citations: citations are not served; remove them")
    return Text(text), cache_mark(block.get("cache_control"), f"{where}.cache_control")


def _tool_use(block: dict[str, Any], where: str) -> tuple[ToolUse, bool]:
    only(block, ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"), where)
    use_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(use_id, str) or not TOOL_USE_ID.fullmatch(use_id):
        raise BadRequest(f"{where}.id must be 1 to 256 letters, digits, '_' or '-'")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be the name of the tool called")
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}.input must be an object: the tool's arguments")
    if block.get("caller") not in (None, {"type": "direct"}):
        raise BadRequest(f"{where}.caller: only direct calls are served (no code execution); remove caller")
    if block.get("toolset_name") is not None:
        raise BadRequest(f"{where}.toolset_name: toolsets are not served; remove it")
    return ToolUse(use_id, name, json.dumps(arguments, ensure_ascii=False)), cache_mark(
        block.get("cache_control"), f"{where}.cache_control"
    )


def _tool_result(block: dict[str, Any], where: str) -> tuple[ToolResult, bool]:
    only(block, ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"), where)
    use_id, content, is_error = block.get("tool_use_id"), block.get("content"), block.get("is_error", False)
    if not isinstance(use_id, str) or not use_id:
        raise BadRequest(f"{where}.tool_use_id must name the tool_use block this result answers")
    if not isinstance(is_error, bool):
        raise BadRequest(f"{where}.is_error must be true or false")
    if block.get("toolset_name") is not None:
        raise BadRequest(f"{where}.toolset_name: toolsets are not served; remove it")
    marked = cache_mark(block.get("cache_control"), f"{where}.cache_control")
    if content is None or isinstance(content, str):
        return ToolResult(use_id, content or "", is_error), marked
    if not isinstance(content, list) or len(content) > MAX_BLOCKS:
        raise BadRequest(f"{where}.content must be a string or a list of at most {MAX_BLOCKS} text blocks")
    inner = [_text_block(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
    text = "".join(part.text for part, _ in inner)
    return ToolResult(use_id, text, is_error), marked or any(mark for _, mark in inner)


def cache_mark(control: object, where: str) -> bool:
    """Whether a `cache_control` value (at `where`) sets a breakpoint."""
    if control is None:
        return False
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise BadRequest(f'{where} must be {{"type": "ephemeral"}} (with an optional ttl)')
    only(control, ("type", "ttl"), where)
    if control.get("ttl", "5m") not in CACHE_TTLS:
        raise BadRequest(f"{where}.ttl must be one of {', '.join(CACHE_TTLS)}")
    return True


def _check_order(turns: list[Turn]) -> None:
    """A user turn opens the conversation (system turns aside) and the last turn is not the assistant's;
    a user turn's tool_results come before its text, each answers a tool_use of the assistant turn just
    before it, and every tool_use is answered there, once."""
    spoken = [turn for turn in turns if turn.role != "system"]
    if not spoken:
        raise BadRequest("messages hold no user message; send at least one")
    if spoken[0].role != "user":
        raise BadRequest(f"{spoken[0].source} is an assistant message; the conversation starts with a user message")
    if turns[-1].role == "assistant":
        raise BadRequest(
            f"{turns[-1].source} is an assistant message at the end: prefilling the answer is not served; end "
            "with a user message"
        )
    seen: set[str] = set()
    for before, turn in zip((None, *turns), turns, strict=False):
        asked = [b.id for b in before.blocks if isinstance(b, ToolUse)] if before is not None else []
        _check_results(turn, asked, seen)
        seen.update(asked)


def _check_results(turn: Turn, asked: list[str], seen: set[str]) -> None:
    if len(set(asked)) != len(asked) or seen & set(asked):
        raise BadRequest(f"{turn.source}: the tool_use block before it reuses an id; give each tool_use its own id")
    results = [b for b in turn.blocks if isinstance(b, ToolResult)]
    answered = [result.tool_use_id for result in results]
    if any(isinstance(b, ToolResult) for b in turn.blocks[len(results) :]):
        raise BadRequest(f"{turn.source}: tool_result blocks must come before the message's text blocks")
    unknown = [use_id for use_id in answered if use_id not in asked]
    if unknown:
        raise BadRequest(
            f"{turn.source} holds a tool_result for {shown(unknown[0])}, which the assistant message just before "
            "it did not call (tool_use id); answer the calls of the turn before"
        )
    if len(set(answered)) != len(answered):
        raise BadRequest(f"{turn.source} answers one tool_use twice; send one tool_result per call")
    missing = [use_id for use_id in asked if use_id not in answered]
    if missing:
        raise BadRequest(
            f"{turn.source} lacks a tool_result for tool_use {shown(missing[0])} of the assistant message before "
            "it; answer every call right after it"
        )


def only(value: dict[str, Any], fields: tuple[str, ...], where: str) -> None:
    for key in value:
        if key not in fields:
            name = key if len(key) <= 40 and key.isprintable() else shown(key)
            raise BadRequest(f"{where}.{name} is not a field here; remove it")


def _owner(kind: str) -> str:
    return "assistant" if kind == "tool_use" else "user"


def _is_server_tool_block(kind: str) -> bool:
    return kind in ("server_tool_use", "mcp_tool_use", "mcp_tool_result") or kind.endswith("_tool_result")
