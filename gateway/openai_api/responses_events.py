"""The server-sent events of a streamed response, in OpenAI's order, each with its sequence number:

    response.created, response.in_progress
    response.output_item.added (the message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done
    for each call: response.output_item.added (the function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete | response.failed

The message opens with its first text; an answer that is calls alone has no message (the pipeline holds back
text that may still be a call, and reads the calls at the end, so they come whole, after the text).
"""

import json
from typing import Any

from gateway.openai_api.responses_items import function_call_item, output_message, output_text_part
from gateway.openai_api.responses_objects import ProducedOutput, ResponseRecord, response_json
from gateway.types import ToolCall


class ResponseEvents:
    def __init__(self, record: ResponseRecord, produced: ProducedOutput) -> None:
        self._record = record
        self._produced = produced
        self._sequence = 0
        self._message_open = False

    def opening(self) -> list[dict[str, Any]]:
        response = response_json(self._record)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def text(self, delta: str) -> list[dict[str, Any]]:
        """The events of a text delta the produced output took in (none for no text)."""
        if not delta:
            return []
        events = self._open_message()
        where = {"item_id": self._produced.message_id, "output_index": 0, "content_index": 0}
        return [*events, self._event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    def closing(self) -> list[dict[str, Any]]:
        """The events after the last output: the message and the calls done, then the record's own ending
        (completed or incomplete; the record was finished first)."""
        produced, events = self._produced, []
        text = "".join(produced.text)
        index = 0
        if text or not produced.tool_calls:
            events += self._open_message()
            where = {"item_id": produced.message_id, "output_index": 0}
            events.append(self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=output_text_part(text))
            )
            item = output_message(produced.message_id, text, produced.status)
            events.append(self._event("response.output_item.done", output_index=0, item=item))
            index = 1
        for offset, (item_id, call) in enumerate(zip(produced.call_item_ids, produced.tool_calls, strict=True)):
            events += self._call(index + offset, item_id, call)
        kind = "response.incomplete" if self._record.status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=response_json(self._record))]

    def failed(self) -> list[dict[str, Any]]:
        return [self._event("response.failed", response=response_json(self._record))]

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message_open:
            return []
        self._message_open = True
        item_id = self._produced.message_id
        return [
            self._event("response.output_item.added", output_index=0, item=output_message(item_id, "", "in_progress")),
            self._event(
                "response.content_part.added",
                item_id=item_id,
                output_index=0,
                content_index=0,
                part=output_text_part(""),
            ),
        ]

    def _call(self, index: int, item_id: str, call: ToolCall) -> list[dict[str, Any]]:
        where = {"item_id": item_id, "output_index": index}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, "in_progress", arguments=""),
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event(
                "response.output_item.done", output_index=index, item=function_call_item(item_id, call, "completed")
            ),
        ]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def sse(event: dict[str, Any]) -> bytes:
    """One event as OpenAI sends it: its type on an `event:` line, the event as JSON on the `data:` line."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
