"""Anthropic's Messages API bodies mapped onto the gateway's GenerationRequest (the same chat, tools and
sampling a chat completion maps to), its refusals, and the answer's figures: stop reasons, usage with
cache_control breakpoints, the rate-limit headers under Anthropic's names."""

import json
from datetime import UTC, datetime

import pytest

from gateway.anthropic_api.cache import shared_prefix_length, usage_json
from gateway.anthropic_api.conversation import ERROR_PREFIX
from gateway.anthropic_api.headers import duration_ms, rate_limit_headers, reset_time
from gateway.anthropic_api.params import BadRequest
from gateway.anthropic_api.requests import count_tokens_request, messages_request
from gateway.anthropic_api.responses import content_blocks, matched_stop, message_id, stop_reason
from gateway.openai_api.requests import to_generation_request
from gateway.planning.tokenization import tokenizer_for
from gateway.types import (
    ChatMessage,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    Tool,
    ToolCall,
    ToolChoice,
    Usage,
)

MODEL = "diptych-tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}


def generation(**fields) -> GenerationRequest:
    return messages_request(body(**fields), "").generation


def test_a_message_maps_onto_the_chat_completion_of_the_same_request():
    """The same conversation, sampling and tools sent to either API is the same GenerationRequest (and so the
    same prompt, plan and idempotency fingerprint)."""
    anthropic = messages_request(
        {
            "model": MODEL,
            "max_tokens": 7,
            "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "stop_sequences": ["x", "yz"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "metadata": {"user_id": "user-7"},
            "tools": [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        },
        "key-1",
    ).generation
    openai = to_generation_request(
        {
            "model": MODEL,
            "max_tokens": 7,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}],
            "stop": ["x", "yz"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "user": "user-7",
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        },
        chat=True,
        idempotency_key="key-1",
    )
    assert anthropic == openai


def test_a_tool_round_trip_becomes_the_assistant_s_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": "weather in Oslo and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no"}],
                 "is_error": True},
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]  # fmt: skip
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    request = generation(messages=messages, tools=tools, tool_choice={"type": "any"})
    assert request.chat == [
        ChatMessage("user", "weather in Oslo and Rome?"),
        ChatMessage(
            "assistant",
            "Looking.",
            tool_calls=(
                ToolCall("toolu_1", "get_weather", '{"city": "Oslo"}'),
                ToolCall("toolu_2", "get_weather", '{"city": "Rome"}'),
            ),
        ),
        ChatMessage("tool", "rain", tool_call_id="toolu_1"),
        ChatMessage("tool", ERROR_PREFIX + "no", tool_call_id="toolu_2"),
        ChatMessage("user", "and tomorrow?"),
    ]
    assert request.tools == (Tool("get_weather", "", json.dumps(WEATHER)),)
    assert request.tool_choice == ToolChoice("required") and request.parallel_tool_calls is None


@pytest.mark.parametrize(
    ("choice", "mode", "function", "parallel"),
    [
        ({"type": "auto"}, "auto", "", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", "", False),
        ({"type": "tool", "name": "f"}, "function", "f", None),
        ({"type": "none"}, "none", "", None),
    ],
)
def test_tool_choices_map_onto_the_chat_api_s(choice, mode, function, parallel):
    request = generation(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice=choice)
    assert request.tool_choice == ToolChoice(mode, function) and request.parallel_tool_calls is parallel


def test_auto_and_none_without_tools_ask_for_nothing():
    for kind in ("auto", "none"):
        request = generation(tool_choice={"type": kind})
        assert request.tool_choice is None and request.tools == ()


def test_consecutive_turns_of_one_role_are_one_turn_and_system_messages_join_the_chat():
    request = generation(
        system="rules",
        messages=[
            {"role": "system", "content": " and more"},
            {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
        ],
    )
    assert request.chat == [
        ChatMessage("system", "rules and more"),
        ChatMessage("user", "ab"),
        ChatMessage("assistant", "c"),
        ChatMessage("user", "d"),
    ]


def test_unset_options_stay_unset():
    request = generation()
    assert request == GenerationRequest(model=MODEL, chat=[ChatMessage("user", "hi")], max_tokens=8)
    assert messages_request(body(), "").stream is False and messages_request(body(stream=True), "").stream


def _marked(text: str) -> dict:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


def test_the_last_cache_breakpoint_cuts_the_conversation_after_its_block():
    first = [{"type": "text", "text": "1"}, _marked("two"), {"type": "text", "text": "3"}]
    asked = messages_request(
        body(
            system=[_marked("sys")],
            messages=[
                {"role": "user", "content": first},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "five"},
            ],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
            stop_sequences=["x"],
        ),
        "",
    )  # fmt: skip
    assert asked.cache_prefix == GenerationRequest(
        model=MODEL,
        chat=[ChatMessage("system", "sys"), ChatMessage("user", "1two")],
        tools=(Tool("f", "", '{"type": "object"}'),),
        tool_choice=ToolChoice("none"),  # rendered and tokenized only
    )
    assert messages_request(body(), "").cache_prefix is None


def test_a_breakpoint_in_the_tools_cuts_the_tools_and_the_request_s_own_marks_the_last_block():
    tools = [
        {"name": "a", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
        {"name": "b", "input_schema": {"type": "object"}},
    ]
    in_tools = messages_request(body(tools=tools), "").cache_prefix
    assert in_tools is not None and [t.name for t in in_tools.tools] == ["a"]
    assert in_tools.chat == [ChatMessage("user", "")]
    whole = messages_request(body(cache_control={"type": "ephemeral", "ttl": "1h"}, tools=tools), "").cache_prefix
    assert whole is not None and whole.chat == [ChatMessage("user", "hi")] and len(whole.tools) == 2


def test_count_tokens_renders_the_conversation_with_its_tools_and_compiles_nothing():
    request = count_tokens_request(
        {
            "model": MODEL,
            "system": "s",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
        }
    )
    assert request == GenerationRequest(
        model=MODEL,
        chat=[ChatMessage("system", "s"), ChatMessage("user", "hi")],
        tools=(Tool("f", "", '{"type": "object"}'),),
        tool_choice=ToolChoice("none"),
    )


REFUSED = [
    ({"max_tokens": None}, "max_tokens is required"),
    ({"max_tokens": 0}, "max_tokens 0 (warming the cache without an answer) is not served"),
    ({"max_tokens": "8"}, "max_tokens must be an integer"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"model": 7}, "model is required"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": "hi"}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content is empty"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content must be a non-empty string"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name is not a field here"),
    ({"messages": [{"role": "human", "content": "hi"}]}, "messages[0].role is 'human'"),
    ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]},
     "messages[0] is an assistant message; the conversation starts with a user message"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]},
     "prefilling the answer is not served"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]},
     "holds a tool_result for 't1', which the assistant message just before it did not call"),
    ({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": "what?"}]},
     "messages[2] lacks a tool_result for tool_use 't1'"),
    ({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "t1"}]}]},
     "tool_result blocks must come before the message's text blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "is a tool_use block in a user message"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0] is a image block: this platform's models read text only"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "read text only"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}]}, "no model here thinks"),
    ({"messages": [{"role": "user", "content": [{"type": "web_search_tool_result"}]}]}, "server tools are not served"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "has type 'video'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "text must be a non-empty string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{}]}]}]},
     "citations are not served"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}}]}]},
     'cache_control must be {"type": "ephemeral"}'),
    ({"messages": [{"role": "user", "content": [_marked(str(i)) for i in range(5)]}]},
     "holds 5 cache_control breakpoints; send at most 4"),
    ({"system": 5}, "system must be a string or a list of text blocks"),
    ({"stop_sequences": "x"}, "stop_sequences must be a list of strings"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences holds 5 strings; send at most 4"),
    ({"stop_sequences": [""]}, "each of stop_sequences must be 1 to 64 characters long"),
    ({"temperature": 1.5}, "temperature must be a number from 0 to 1"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 10**400}, "top_p must be a number"),
    ({"top_k": -1}, "top_k must be an integer from 0"),
    ({"stream": "yes"}, "stream must be true or false"),
    ({"metadata": {"user_id": "a b"}}, "metadata.user_id must be 1 to 128 characters"),
    ({"metadata": {"session": "1"}}, "metadata.session is not a field here"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools are not served"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema is required"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name must be 1 to 64 letters"),
    ({"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]}, "'f' is given twice"),
    ({"tools": [{"name": "f", "input_schema": {}, "defer_loading": True}]}, "tool search is not served"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "sometimes"}}, "tool_choice must be"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "needs the name of the tool"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking: no model here thinks"),
    ({"container": "c1"}, "container: containers (code execution) are not served"),
    ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers: MCP servers are not served"),
    ({"service_tier": "priority"}, "service_tier must be one of auto, standard_only"),
    ({"speed": "fast"}, 'speed: speed "fast" is not served'),
    ({"output_config": {"effort": "high"}}, "output_config"),
    ({"best_of": 2}, "'best_of' is not a parameter of /v1/messages; remove it"),
    ({"n": 2}, "'n' is not a parameter of /v1/messages"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), REFUSED)
def test_what_is_refused_is_refused_by_name(fields, message):
    with pytest.raises(BadRequest) as refused:
        messages_request(body(**fields), "")
    assert message in refused.value.message and refused.value.status == 400


@pytest.mark.parametrize(
    "fields",
    [
        {"thinking": {"type": "disabled"}, "service_tier": "standard_only", "speed": "standard", "mcp_servers": []},
        {"service_tier": "auto", "container": None, "metadata": {"user_id": None}, "system": ""},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": None}]}]},
    ],
)
def test_the_off_values_of_what_is_not_served_are_accepted(fields):
    assert messages_request(body(**fields), "").generation.max_tokens == 8


def test_count_tokens_knows_its_own_keys():
    with pytest.raises(BadRequest, match="'max_tokens' is not a parameter of /v1/messages/count_tokens"):
        count_tokens_request(body())


def test_usage_splits_the_prompt_at_the_cached_tokens_and_the_last_breakpoint():
    # 100 prompt tokens, 64 of them cached, the breakpoint after token 90: 26 written, 10 after the breakpoint.
    assert usage_json(Usage(100, 5, 64), marked=90) == {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation_input_tokens": 26,
        "cache_read_input_tokens": 64,
    }
    assert usage_json(Usage(100, 5, 0), marked=0)["input_tokens"] == 100  # no breakpoint, nothing cached
    assert usage_json(Usage(100, 5, 80), marked=30)["cache_creation_input_tokens"] == 0  # cached past the mark
    for cached, marked in ((0, 100), (99, 100), (16, 200), (32, 0)):
        usage = usage_json(Usage(100, 1, cached), marked)
        parts = (usage["input_tokens"], usage["cache_creation_input_tokens"], usage["cache_read_input_tokens"])
        assert sum(parts) == 100 and min(parts) >= 0


def test_the_shared_prefix_is_counted_to_the_first_difference():
    assert shared_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert shared_prefix_length([1, 2], [1, 2, 3]) == 2 and shared_prefix_length([], [1]) == 0


def _last(finish: FinishReason, calls: tuple[ToolCall, ...] = ()) -> GenerationOutput:
    return GenerationOutput("exec_1", "", [], finish, tool_calls=calls)


def test_stop_reasons_and_the_stop_sequence_matched():
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    ids = tokenizer("hello world, goodbye", add_special_tokens=False)["input_ids"]
    assert matched_stop("hello", ids, ["bye", " wor"], tokenizer) == " wor"
    assert stop_reason(_last(FinishReason.STOP), "hello", ids, [", g", " wor"], tokenizer) == ("stop_sequence", " wor")
    assert stop_reason(_last(FinishReason.STOP), "hello world, goodbye", ids, ["x"], tokenizer) == ("end_turn", None)
    assert stop_reason(_last(FinishReason.STOP), "hello", ids, [], tokenizer) == ("end_turn", None)
    assert stop_reason(_last(FinishReason.LENGTH), "hello", ids, [" wor"], tokenizer) == ("max_tokens", None)
    call = ToolCall("call_abc", "f", '{"a": 1}')
    assert stop_reason(_last(FinishReason.STOP, (call,)), "", ids, [], tokenizer) == ("tool_use", None)
    assert stop_reason(_last(FinishReason.INTERRUPTED), "", ids, [], tokenizer) == ("pause_turn", None)


def test_content_blocks_and_ids_in_anthropic_s_forms():
    assert message_id("exec_0123abcd") == "msg_0123abcd"
    blocks = content_blocks("hi", (ToolCall("call_7f", "f", '{"a": [1]}'),))
    assert blocks == [
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "toolu_7f", "name": "f", "input": {"a": [1]}},
    ]
    assert content_blocks("", ()) == []


@pytest.mark.parametrize(
    ("text", "milliseconds"),
    [("0s", 0), ("120ms", 120), ("1s", 1000), ("1.5s", 1500), ("6m0s", 360_000), ("1m30.5s", 90_500),
     ("1h0m0s", 3_600_000)],
)  # fmt: skip
def test_reset_durations_read_back(text, milliseconds):
    assert duration_ms(text) == milliseconds


def test_rate_limit_headers_mirror_openai_s_under_anthropic_s_names():
    now = datetime(2026, 12, 1, 10, 0, 0, 500_000, tzinfo=UTC)
    assert reset_time("6m0s", now) == "2026-12-01T10:06:01Z"  # rounded up to the second
    assert reset_time("0s", now.replace(microsecond=0)) == "2026-12-01T10:00:00Z"
    headers = rate_limit_headers(
        (
            ("x-ratelimit-limit-requests", "3"),
            ("x-ratelimit-remaining-requests", "2"),
            ("x-ratelimit-reset-requests", "20s"),
            ("request-id", "exec_1"),
        )
    )
    assert headers["anthropic-ratelimit-requests-limit"] == "3" and headers["x-ratelimit-limit-requests"] == "3"
    assert headers["anthropic-ratelimit-requests-remaining"] == "2"
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z") and "request-id" not in headers
    assert not any("tokens" in name for name in headers)  # a family with no limit is left out, as OpenAI's
