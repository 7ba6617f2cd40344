"""Grammars at the door, over a real colocated worker of the built-in model: a schema no worker could follow
(one that only refers to itself) is the client's 400 before any worker runs its prompt; a tool's `$ref`s
resolve inside its own parameters; and the error a worker ends a request with reaches the client in words
of its kind and the request's id, never in the worker's own (its id, a grammar's parser state)."""

import json
import logging
from contextlib import asynccontextmanager

import grpc
import jsonschema
import pytest

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import llguidance_tokenizer
from diptych_common.worker_credential import WorkerSecret
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.fleet.channels import Channels
from gateway.planning import structured, tools
from gateway.planning.tokenization import tokenizer_for
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, assert_openai_error_shape, in_process_gateway
from tests.workers.conftest import executor, tiny_model, wait_until  # noqa: F401 - the workers' fixtures
from tests.workers.serving import SECRET, Worker
from workers.serving.server import Role
from workers.structured.compiler import GrammarCompiler

WORKER_ID = "colocated-0"
MESSAGES = [{"role": "user", "content": "call it"}]
ONLY_ITSELF = {"$ref": "#"}


@asynccontextmanager
async def gateway_and_worker(tmp_path, tiny_model, executor):  # noqa: F811 - the fixtures, passed on
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    grammars = GrammarCompiler(llguidance_tokenizer(tokenizer, DIPTYCH_TINY.llama_config["vocab_size"], frozenset()))
    worker = Worker(Role.COLOCATED, tiny_model, executor, allow_shm=False, grammars=grammars)
    await worker.start()
    entry = {"id": WORKER_ID, "role": "colocated", "model": MODEL, "region": "local", "address": worker.address}
    channels = Channels(WorkerSecret(SECRET))
    try:
        control_plane = ControlPlaneInMemory(workers=[entry | {"state": "ready"}])
        async with in_process_gateway(tmp_path, control_plane, channels=channels, mode=ServingMode.COLOCATED) as gw:
            assert await wait_until(lambda: gw.path.board.is_fresh(WORKER_ID), timeout=10)
            yield gw, worker
    finally:
        await channels.close()
        await worker.stop()


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def _post(gateway, body: dict):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with gateway.http.post("/v1/chat/completions", json=body, headers=headers) as response:
        return response.status, response.headers, await response.read()


def _let_the_worker_fail_it(monkeypatch) -> None:
    """No check at the door, and a tool's parameters not a document of their own in the list of calls."""
    monkeypatch.setattr(structured, "grammar_problem", lambda grammar, model_source: None)
    monkeypatch.setattr(tools, "_own_document", tools.tool_parameters)


def _ran_nothing(gateway, worker) -> bool:
    return gateway.path.runs == 0 and worker.engine.prompt_tokens_computed == 0 and worker.engine.steps_run == 0


@pytest.mark.parametrize(
    ("fields", "param", "where"),
    [
        ({"tools": [_tool(ONLY_ITSELF)], "tool_choice": "required"}, "tools", "tools[0].function.parameters"),
        ({"tools": [_tool(ONLY_ITSELF)]}, "tools", "tools[0].function.parameters"),
        ({"response_format": _schema_format(ONLY_ITSELF)}, "response_format", "response_format.json_schema.schema"),
    ],
)
async def test_a_schema_that_only_refers_to_itself_is_a_400_before_any_worker_runs(
    tmp_path,
    tiny_model,  # noqa: F811
    executor,  # noqa: F811
    fields,
    param,
    where,
):
    async with gateway_and_worker(tmp_path, tiny_model, executor) as (gateway, worker):
        status, _, raw = await _post(gateway, {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, **fields})
        assert status == 400, raw
        payload = json.loads(raw)
        assert_openai_error_shape(payload)
        assert payload["error"]["param"] == param
        message = payload["error"]["message"]
        assert f"{where} is not a schema this platform can follow: no JSON value satisfies it" in message
        assert "<state>" not in message and WORKER_ID not in message
        assert _ran_nothing(gateway, worker)


async def test_grpc_refuses_it_as_invalid_argument_before_any_worker_runs(
    tmp_path,
    tiny_model,  # noqa: F811
    executor,  # noqa: F811
):
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="call it")])
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        chat=chat,
        tools=[inference_pb2.Tool(name="f", parameters=json.dumps(ONLY_ITSELF))],
        tool_choice=inference_pb2.ToolChoice(mode="required"),
    )
    async with gateway_and_worker(tmp_path, tiny_model, executor) as (gateway, worker):
        stub = inference_pb2_grpc.InferenceStub(gateway.channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),)):
                pass
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "tools[0].function.parameters is not a schema this platform can follow" in raised.value.details()
        assert _ran_nothing(gateway, worker)


async def test_a_tool_s_refs_resolve_inside_its_own_parameters(
    tmp_path,
    tiny_model,  # noqa: F811
    executor,  # noqa: F811
):
    """`#/$defs/...` in a tool's parameters names the parameters' own $defs: it was looked up in the list
    of calls the gateway builds around them, and every such tool was refused."""
    parameters = {
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/name"}},
        "required": ["city"],
        "additionalProperties": False,
        "$defs": {"name": {"type": "string", "maxLength": 4}},
    }
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "tools": [_tool(parameters)]}
    async with gateway_and_worker(tmp_path, tiny_model, executor) as (gateway, _):
        status, _, raw = await _post(gateway, body | {"tool_choice": "required", "temperature": 0})
    assert status == 200, raw
    calls = json.loads(raw)["choices"][0]["message"]["tool_calls"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


async def test_a_worker_s_failure_reaches_the_client_without_the_worker_s_words(
    tmp_path,
    tiny_model,  # noqa: F811
    executor,  # noqa: F811
    monkeypatch,
    caplog,
):
    """The door's fixes are undone, so that the schema reaches the worker as it once did: its `$ref` names
    the list of calls, which the worker's parser cannot finish, and the worker fails the request (INTERNAL,
    its message holding the parser's state) on each try. The client is told the kind and the request's id;
    the gateway's log has the worker's words."""
    _let_the_worker_fail_it(monkeypatch)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "tools": [_tool(ONLY_ITSELF)]}
    body["tool_choice"] = "required"
    async with gateway_and_worker(tmp_path, tiny_model, executor) as (gateway, worker):
        with caplog.at_level(logging.WARNING, logger="gateway.core.request_path"):
            status, headers, raw = await _post(gateway, body)
            streamed_status, streamed_headers, streamed = await _post(gateway, body | {"stream": True})
        assert worker.engine.prompt_tokens_computed > 0  # it did run on the worker
    assert status == 500, raw
    payload = json.loads(raw)
    assert_openai_error_shape(payload)
    execution_id = headers["X-Request-Id"]
    assert payload["error"]["message"] == (
        f"the request failed inside the platform; retry it, and quote request id {execution_id} if it fails again"
    )
    assert payload["error"]["type"] == "server_error"
    assert streamed_status == 200
    event = json.loads(streamed.decode().split("data: ")[-2])  # the last event before [DONE]
    assert event["error"]["message"].startswith("the request failed inside the platform")
    assert streamed_headers["X-Request-Id"] in event["error"]["message"]
    for told in (raw.decode(), streamed.decode()):
        assert WORKER_ID not in told and "<state>" not in told and "NoExtensionBias" not in told
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert WORKER_ID in logged and "INTERNAL" in logged


async def test_grpc_tells_a_worker_s_failure_without_the_worker_s_words(
    tmp_path,
    tiny_model,  # noqa: F811
    executor,  # noqa: F811
    monkeypatch,
):
    _let_the_worker_fail_it(monkeypatch)
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="call it")])
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        chat=chat,
        max_tokens=100,
        tools=[inference_pb2.Tool(name="f", parameters=json.dumps(ONLY_ITSELF))],
        tool_choice=inference_pb2.ToolChoice(mode="required"),
    )
    async with gateway_and_worker(tmp_path, tiny_model, executor) as (gateway, _):
        stub = inference_pb2_grpc.InferenceStub(gateway.channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),)):
                pass
    assert raised.value.code() is grpc.StatusCode.INTERNAL
    execution_id = dict(raised.value.trailing_metadata())["request-id"]
    assert raised.value.details() == (
        f"the request failed inside the platform; retry it, and quote request id {execution_id} if it fails again"
    )
