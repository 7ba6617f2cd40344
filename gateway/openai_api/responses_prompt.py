"""A response's prompt token ids: its conversation rendered with the model's chat template, or, when it
continues a stored response (`previous_response_id`), that response's own token ids extended by the new turn,
so that the prefix caches (and the router, which prefers the worker holding the longest prefix) reuse the
conversation's KV exactly.

The rule of a continuation. A stored response keeps the token ids it ran on and those it generated, as
generated: P + O. The new turn is rendered as the chat template renders what follows an assistant's turn:
the whole conversation is rendered once with the assistant's turn standing in as a marker (its text does not
matter: its tokens are O) and once without it and the new turn, with the generation prompt; the text after the
marker is the new turn, closing the assistant's turn first. When the output ended with the end-of-sequence
token and that text starts with it, it is left out, as O holds it already. The prompt is then
P + O + tokens(that text). Where the template renders the earlier turns the same with a turn after them (the
text before the marker is the earlier conversation with its generation prompt), this is the whole
conversation's rendering, token for token, whenever O is the tokenization of the output's text and the text
breaks at a special token (as templates close turns); where it does not, or the instructions or tools
changed (the system prompt starts the conversation), the whole conversation is rendered afresh.

Too long: with truncation "disabled" a prompt that leaves no room for max_output_tokens (at least one token)
is refused (context_length_exceeded); with "auto" the oldest items are dropped, the instructions kept, until
it fits.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from gateway.fleet.registry import ModelInfo
from gateway.openai_api.responses_items import chat_messages, item_text
from gateway.planning.json_body import TooDeep
from gateway.planning.tokenization import encode_chat
from gateway.planning.tools import template_calls, template_tools
from gateway.planning.validation import CHAT_ROLES, max_prompt_bytes
from gateway.types import ChatMessage, Tokenizer, Tool

TURN_MARKER = "\u2063diptych-assistant-turn\u2063"


class PromptRefused(Exception):
    """Why a response's conversation cannot be its prompt; `code`: OpenAI's error code, where it has one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class EarlierConversation:
    """What a stored response leaves to the turn that continues it."""

    model: str
    token_ids: list[int]  # its prompt and its output, as generated
    items_before_output: list[dict[str, Any]]  # the items it was asked about: the conversation before it, and its input
    output_items: list[dict[str, Any]]
    instructions: str | None
    tools: tuple[Tool, ...]


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    messages: list[ChatMessage]  # the conversation the token ids render
    continued: bool  # the earlier conversation's token ids, extended by the new turn
    dropped_items: int = 0  # the oldest items left out to fit (truncation "auto")


def response_prompt(
    tokenizer: Tokenizer,
    model: ModelInfo,
    instructions: str | None,
    tools: tuple[Tool, ...],
    items: list[dict[str, Any]],
    earlier: EarlierConversation | None,
    output_room: int,
    truncate: bool,
) -> Prompt:
    """The prompt of a response whose input is `items` (after `earlier`, when it continues one), leaving
    `output_room` tokens of the model's context for its output. Runs on a tokenizer thread."""
    if not tokenizer.chat_template:
        raise PromptRefused("this model has no chat template; send a completion to /v1/completions instead")
    _check_bytes(items, model, truncate)
    if earlier is not None and (earlier.model, earlier.instructions, earlier.tools) == (
        model.name,
        instructions,
        tools,
    ):
        tail = following_turn(tokenizer, earlier, items)
        every_item = earlier.items_before_output + earlier.output_items + items
        if tail is not None and len(earlier.token_ids) + len(tail) + output_room <= model.context_length:
            return Prompt(earlier.token_ids + tail, chat_messages(every_item, instructions), continued=True)
    every_item = items if earlier is None else earlier.items_before_output + earlier.output_items + items
    return _whole(tokenizer, model, instructions, tools, every_item, output_room, truncate)


def following_turn(tokenizer: Tokenizer, earlier: EarlierConversation, items: list[dict[str, Any]]) -> list[int] | None:
    """The token ids that follow the earlier conversation's own (prompt and output) for the new turn `items`;
    None where the template does not render the earlier turns as a prefix of the whole conversation."""
    tools: list[dict[Any, Any] | Callable[..., Any]] | None = [*template_tools(earlier.tools)] or None
    head = template_messages(chat_messages(earlier.items_before_output, earlier.instructions))
    marked = [*head, {"role": "assistant", "content": TURN_MARKER}, *template_messages(chat_messages(items, None))]
    try:
        before = tokenizer.apply_chat_template(head, tools=tools, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template(marked, tools=tools, add_generation_prompt=True, tokenize=False)
    except TemplateError:
        return None
    if not isinstance(before, str) or not isinstance(whole, str):  # what tokenize=False returns
        raise TypeError("the chat template rendered something other than text")
    if not whole.startswith(before + TURN_MARKER) or whole.count(TURN_MARKER) != 1:
        return None
    tail = whole[len(before) + len(TURN_MARKER) :]
    eos = tokenizer.eos_token
    if eos and earlier.token_ids and earlier.token_ids[-1] == tokenizer.eos_token_id and tail.startswith(eos):
        tail = tail[len(eos) :]
    ids: list[int] = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return ids


def _whole(
    tokenizer: Tokenizer,
    model: ModelInfo,
    instructions: str | None,
    tools: tuple[Tool, ...],
    items: list[dict[str, Any]],
    output_room: int,
    truncate: bool,
) -> Prompt:
    """The whole conversation rendered; with `truncate`, the fewest oldest items left out that make it fit."""
    items = _within_bytes(items, model) if truncate else items

    def rendered(dropped: int) -> list[int]:
        return _render(tokenizer, instructions, tools, _kept(items, dropped))

    ids = rendered(0)
    if _fits(ids, model, output_room):
        return Prompt(ids, chat_messages(items, instructions), continued=False)
    if not truncate or len(items) == 1:
        raise _too_long(len(ids), model, output_room, truncate)
    low, high = 1, len(items) - 1  # the fewest dropped that fit lie in [low, high], if any do
    if not _fits(rendered(high), model, output_room):
        raise _too_long(len(rendered(high)), model, output_room, truncate)
    while low < high:
        middle = (low + high) // 2
        if _fits(rendered(middle), model, output_room):
            high = middle
        else:
            low = middle + 1
    kept = _kept(items, low)
    return Prompt(
        rendered(low), chat_messages(kept, instructions), continued=False, dropped_items=len(items) - len(kept)
    )


def _kept(items: list[dict[str, Any]], dropped: int) -> list[dict[str, Any]]:
    """The items after the `dropped` oldest, without function call outputs whose calls were dropped."""
    kept = items[dropped:]
    while len(kept) > 1 and kept[0]["type"] == "function_call_output":
        kept = kept[1:]
    return kept


def _render(
    tokenizer: Tokenizer, instructions: str | None, tools: tuple[Tool, ...], items: list[dict[str, Any]]
) -> list[int]:
    messages = template_messages(chat_messages(items, instructions))
    try:
        return encode_chat(tokenizer, messages, template_tools(tools))
    except TemplateError as error:
        raise PromptRefused(f"the model's chat template cannot render this conversation: {str(error)[:200]}") from None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them (as the chat completions front renders them)."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": CHAT_ROLES[message.role], "content": message.content}
        if message.tool_calls:
            try:
                entry["tool_calls"] = template_calls(message.tool_calls)
            except TooDeep:
                raise PromptRefused("a function_call's arguments nest too deep; send flatter arguments") from None
            except ValueError:
                raise PromptRefused("a function_call's arguments are not JSON; send a JSON object as text") from None
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def _fits(ids: list[int], model: ModelInfo, output_room: int) -> bool:
    return len(ids) + output_room <= model.context_length


def _item_bytes(item: dict[str, Any]) -> int:
    if item["type"] == "message":
        text = item_text(item)
    elif item["type"] == "function_call":
        text = item["arguments"] + item["name"]
    else:
        text = item["output"]
    return len(text.encode("utf-8", "surrogatepass"))


def _check_bytes(items: list[dict[str, Any]], model: ModelInfo, truncate: bool) -> None:
    """The new turn alone must fit the model's byte bound (a conversation before it is dropped to fit)."""
    size, limit = sum(_item_bytes(item) for item in items), max_prompt_bytes(model)
    if size > limit and not (truncate and len(items) > 1):
        raise PromptRefused(
            f"input holds {size} bytes of text; {model.name} takes at most {limit} bytes of prompt text",
            "context_length_exceeded",
        )


def _within_bytes(items: list[dict[str, Any]], model: ModelInfo) -> list[dict[str, Any]]:
    """The newest items whose text fits the model's byte bound (at least the last one)."""
    limit, size, start = max_prompt_bytes(model), 0, len(items)
    while start > 0 and size + _item_bytes(items[start - 1]) <= limit:
        start -= 1
        size += _item_bytes(items[start])
    return items[min(start, len(items) - 1) :]


def _too_long(tokens: int, model: ModelInfo, output_room: int, truncate: bool) -> PromptRefused:
    advice = "shorten the input" if truncate else "shorten the input, or set truncation to 'auto'"
    return PromptRefused(
        f"the conversation has {tokens} tokens and the output needs {output_room} more, but {model.name} has a "
        f"context length of {model.context_length}; {advice}",
        "context_length_exceeded",
    )
