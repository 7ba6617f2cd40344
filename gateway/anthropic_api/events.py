"""Anthropic's server-sent events for a streamed message, each an `event:` line and its `data:`:

    message_start                     the message, content empty, usage so far
    ping
    content_block_start (text)        once the first text arrives
    content_block_delta (text_delta)  each text delta
    content_block_stop
    content_block_start (tool_use)    per call, once the calls are read (the pipeline reads a block of
    content_block_delta (input_json_delta)  calls whole: each call's input comes in one delta)
    content_block_stop
    message_delta                     stop_reason, stop_sequence and the final usage
    message_stop

or, once the stream started, an `error` event for a failure, and nothing after it.
"""

import json
from typing import Any

from aiohttp import web

from gateway.anthropic_api.responses import tool_use_block
from gateway.types import ToolCall


class MessageEvents:
    """Writes one message's events to `response`, numbering its content blocks."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._blocks = 0  # content blocks started
        self._text_open = False

    async def start(self, message: dict[str, Any]) -> None:
        await self._send("message_start", {"type": "message_start", "message": message})
        await self._send("ping", {"type": "ping"})

    async def text(self, delta: str) -> None:
        if not delta:
            return
        if not self._text_open:
            await self._start_block({"type": "text", "text": ""})
            self._text_open = True
        await self._delta({"type": "text_delta", "text": delta})

    async def tool_uses(self, calls: tuple[ToolCall, ...]) -> None:
        await self._close_text()
        for call in calls:
            block = tool_use_block(call)
            await self._start_block({**block, "input": {}})
            await self._delta({"type": "input_json_delta", "partial_json": call.arguments})
            await self._stop_block()

    async def finish(self, stop: tuple[str | None, str | None], usage: dict[str, Any]) -> None:
        await self._close_text()
        reason, sequence = stop
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}
        await self._send("message_delta", delta)
        await self._send("message_stop", {"type": "message_stop"})

    async def error(self, body: dict[str, Any]) -> None:
        await self._send("error", body)

    async def _close_text(self) -> None:
        if self._text_open:
            self._text_open = False
            await self._stop_block()

    async def _start_block(self, block: dict[str, Any]) -> None:
        self._blocks += 1
        await self._send(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    async def _delta(self, delta: dict[str, Any]) -> None:
        await self._send("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    async def _stop_block(self) -> None:
        await self._send("content_block_stop", {"type": "content_block_stop", "index": self._index})

    @property
    def _index(self) -> int:
        """The open block's index."""
        return self._blocks - 1

    async def _send(self, event: str, data: dict[str, Any]) -> None:
        payload = json.dumps(data, separators=(",", ":"))
        await self._response.write(f"event: {event}\ndata: {payload}\n\n".encode())
