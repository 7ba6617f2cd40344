"""Tool calls through the whole gateway over a real colocated worker of the built-in model (random weights:
only the grammar makes its output a call), answered as OpenAI answers them: a named tool_choice finishes as
"stop", "required" as "tool_calls"; a call cut off by max_tokens is neither text nor a call, and finishes as
"length". Over HTTP, whole and streamed, and over gRPC."""

import json

import pytest
from transformers import AutoTokenizer

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import llguidance_tokenizer
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.routing.route import ServingMode
from tests.gateway.harness import MODEL, post_json
from tests.workers.test_gateway_sampling_controls import AUTH, COLOCATED, gateway_over, stream_events
from tests.workers.test_structured_outputs import EOS
from workers.structured.compiler import GrammarCompiler

ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
UNIT = {
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
    {"type": "function", "function": {"name": "get_weather", "parameters": UNIT}},
]
NAMED = {"type": "function", "function": {"name": "get_time"}}
QUESTION = "What time is it in Oslo?"


@pytest.fixture(scope="module")
def grammars():
    tokenizer = AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir)
    return GrammarCompiler(llguidance_tokenizer(tokenizer, DIPTYCH_TINY.llama_config["vocab_size"], frozenset({EOS})))


@pytest.fixture
async def gateway(tmp_path, tiny_model, executor, grammars):
    async with gateway_over(tmp_path, tiny_model, executor, COLOCATED, ServingMode.COLOCATED, grammars) as (gw, _):
        yield gw


def chat(tool_choice, max_tokens: int = 150) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
    }


async def whole_choice(gateway, body: dict) -> dict:
    status, answer = await post_json(gateway, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, answer
    return answer["choices"][0]


async def streamed(gateway, body: dict) -> tuple[list[str], list[dict]]:
    """The finish reasons and the deltas of a streamed answer."""
    choices = [chunk["choices"][0] for chunk in await stream_events(gateway, "/v1/chat/completions", body)]
    return [c["finish_reason"] for c in choices if c["finish_reason"]], [c["delta"] for c in choices]


@pytest.mark.parametrize(("tool_choice", "finish"), [(NAMED, "stop"), ("required", "tool_calls")])
async def test_a_named_tool_choice_finishes_as_stop_and_a_chosen_call_as_tool_calls(gateway, tool_choice, finish):
    choice = await whole_choice(gateway, chat(tool_choice))
    assert choice["finish_reason"] == finish
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and json.loads(call["function"]["arguments"])
    finishes, deltas = await streamed(gateway, chat(tool_choice))
    assert finishes == [finish]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == [call["function"]["name"]]


async def test_grpc_answers_a_named_tool_choice_with_stop_too(gateway):
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=QUESTION)]),
        max_tokens=150,
        temperature=0,
        tools=[inference_pb2.Tool(name="get_time", parameters=json.dumps(ZONE))],
        tool_choice=inference_pb2.ToolChoice(function_name="get_time"),
    )
    responses = [r async for r in inference_pb2_grpc.InferenceStub(gateway.channel).Generate(request, metadata=AUTH)]
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_STOP
    assert [call.name for call in responses[-1].tool_calls] == ["get_time"]


async def test_a_call_cut_off_by_max_tokens_is_no_text_and_finishes_as_length(gateway):
    for max_tokens in (2, 6):  # inside the marker, and inside the call's JSON
        choice = await whole_choice(gateway, chat("required", max_tokens))
        assert choice["finish_reason"] == "length"
        assert choice["message"] == {"role": "assistant", "content": ""}
        finishes, deltas = await streamed(gateway, chat("required", max_tokens))
        assert finishes == ["length"]
        assert all(not d.get("content") and "tool_calls" not in d for d in deltas)
