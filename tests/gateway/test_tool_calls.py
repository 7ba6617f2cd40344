"""Tool calls read out of the model's text, streamed and stored: what the grammar guarantees is parsed
into calls; anything else stays content."""

import json

from gateway.accounts.idempotency import replayed_output, stored_response
from gateway.planning.tools import TOOL_CALL_MARKER, ToolCallStream, parse_calls
from gateway.types import FinishReason, GenerationOutput, Tool, ToolCall

TOOLS = (Tool("get_weather", parameters=json.dumps({"type": "object"})), Tool("get_time"))
BLOCK = (
    TOOL_CALL_MARKER + '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
)


def test_a_block_of_calls_becomes_calls_with_fresh_ids():
    calls = parse_calls(BLOCK, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_what_is_not_a_whole_valid_block_is_no_call():
    for text in (BLOCK[:-5], "hello " + BLOCK, BLOCK.replace("get_time", "get_date"), TOOL_CALL_MARKER + "{}"):
        assert parse_calls(text, TOOLS) == ()


def test_a_stream_holds_back_text_only_while_it_may_be_a_block():
    stream = ToolCallStream(TOOLS)
    assert [stream.push(d) for d in ("<tool", "_call>[")] == ["", ""]
    content, calls = stream.end(BLOCK[len("<tool_call>[") :], cut=False)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    text = ToolCallStream(TOOLS)
    assert [text.push(d) for d in ("<to", "day", " it rains")] == ["", "<today", " it rains"]
    assert text.end(".", cut=False) == (".", ())
    short = ToolCallStream(TOOLS)  # an answer that ended of itself on what may start a block is text
    assert short.push("<to") == "" and short.end("", cut=False) == ("<to", ())


def test_a_call_cut_off_by_max_tokens_is_not_shown_as_text():
    for held in ("<to", BLOCK[:20], BLOCK[:40]):
        cut = ToolCallStream(TOOLS)
        assert cut.push(held[:2]) == "" and cut.end(held[2:], cut=True) == ("", ())
    whole = ToolCallStream(TOOLS)  # a block complete on the last token allowed is still its calls
    content, calls = whole.end(BLOCK, cut=True)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    text = ToolCallStream(TOOLS)  # text already known to be text is kept
    assert text.push("it rains") == "it rains" and text.end(" <to", cut=True) == (" <to", ())


def test_a_stored_answer_replays_its_tool_calls():
    output = GenerationOutput(
        "exec_1", "", [5, 6], FinishReason.TOOL_CALLS, tool_calls=(ToolCall("call_1", "get_time", "{}"),)
    )
    replayed = replayed_output(json.loads(json.dumps(stored_response(output))))
    assert replayed.finish_reason is FinishReason.TOOL_CALLS and replayed.tool_calls == output.tool_calls
