"""The server-sent events of a streamed response: OpenAI's order and types, numbered from 0 without a gap,
each valid against the official openai client's event types, and accumulated by the client's own stream
state (what `client.responses.stream` runs) into the same response as the final event's."""

import json

from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.openai_api.responses_events import ResponseEvents, sse
from gateway.openai_api.responses_objects import ProducedOutput, ResponseRecord, error_object
from gateway.openai_api.responses_request import to_responses_request
from gateway.types import FinishReason, GenerationOutput, ToolCall, Usage

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=0)


def record() -> ResponseRecord:
    asked = to_responses_request({"model": "diptych-tiny", "input": "hi", "stream": True})
    return ResponseRecord(
        id="resp_" + "b" * 32,
        organization_id="org_1",
        api_key_id="key_1",
        model="diptych-tiny",
        request=asked.echoed,
        metadata={},
        context_items=[],
        input_items=asked.items,
        prompt_token_ids=[1, 2, 3, 4],
    )


def streamed(outputs: list[GenerationOutput], fail: bool = False) -> tuple[list[dict], ResponseRecord]:
    """The events of `outputs`, as responses_api.py sends them."""
    kept, produced = record(), ProducedOutput()
    events = ResponseEvents(kept, produced)
    sent = events.opening()
    for output in outputs:
        produced.push(output)
        sent += events.text(output.text)
    if fail:
        kept.finish("failed", produced, error_object("server_error", "the request failed inside the platform"))
        return sent + events.failed(), kept
    kept.ended(produced)
    return sent + events.closing(), kept


def checked(events: list[dict]) -> list[str]:
    """The types, after checking each event against the openai types and the numbering."""
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events:
        EVENT.validate_python(event)
    return [event["type"] for event in events]


def test_a_text_answer_streams_in_openais_order():
    events, _ = streamed(
        [
            GenerationOutput("exec_1", "Hel", [5]),
            GenerationOutput("exec_1", "", [6]),
            GenerationOutput("exec_1", "lo", [7], FinishReason.STOP, USAGE),
        ]
    )
    assert checked(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 3
    assert done["output"][0]["content"][0]["text"] == "Hello"


def test_calls_stream_as_function_call_items_after_the_text():
    calls = (ToolCall("call_a", "get_weather", '{"city": "Oslo"}'), ToolCall("call_b", "get_time", "{}"))
    events, _ = streamed([GenerationOutput("exec_1", "", [5], FinishReason.TOOL_CALLS, USAGE, tool_calls=calls)])
    assert checked(events)[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ] * 2 + ["response.completed"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["call_id"], e["item"]["arguments"]) for e in added] == [
        (0, "call_a", ""),
        (1, "call_b", ""),
    ]
    assert [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"] == [
        '{"city": "Oslo"}',
        "{}",
    ]


def test_an_empty_answer_still_has_its_message_and_a_cut_one_ends_incomplete():
    events, _ = streamed([GenerationOutput("exec_1", "", [1], FinishReason.STOP, USAGE)])
    assert "response.output_text.done" in checked(events)
    events, kept = streamed([GenerationOutput("exec_1", "abc", [9], FinishReason.LENGTH, USAGE)])
    assert checked(events)[-1] == "response.incomplete" and kept.status == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failure_ends_the_stream_with_response_failed():
    events, kept = streamed([GenerationOutput("exec_1", "Hel", [5])], fail=True)
    assert checked(events)[-1] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "server_error" and kept.status == "failed"
    assert [item["status"] for item in kept.output_items] == ["incomplete"]  # what it produced, cut short


def test_the_openai_clients_stream_state_accumulates_the_same_response():
    calls = (ToolCall("call_a", "get_weather", '{"city": "Oslo"}'),)
    outputs = [
        GenerationOutput("exec_1", "Let me ", [5]),
        GenerationOutput("exec_1", "look.", [6], FinishReason.TOOL_CALLS, USAGE, tool_calls=calls),
    ]
    events, _ = streamed(outputs)
    state = ResponseStreamState(input_tools=[], text_format=omit)
    handled = []
    for event in events:
        handled += state.handle_event(EVENT.validate_python(event))
    final = handled[-1].response
    assert final.output_text == "Let me look." and final.output[1].name == "get_weather"
    assert final.model_dump(exclude_none=True) == EVENT.validate_python(events[-1]).response.model_dump(
        exclude_none=True
    )


def test_each_event_goes_out_with_its_type_and_one_line_of_json():
    event = {"type": "response.output_text.delta", "sequence_number": 4, "delta": "a\nb"}
    lines = sse(event).decode().split("\n")
    assert lines[0] == "event: response.output_text.delta" and json.loads(lines[1].removeprefix("data: ")) == event
    assert lines[2:] == ["", ""]
