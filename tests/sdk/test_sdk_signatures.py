"""The calls' signatures: `Client` and `AsyncClient` offer the same calls with the same parameters, and
`create`'s parameters, written once as a TypedDict, show in its signature and are checked at each call as
a written-out parameter list would be."""

from __future__ import annotations

import functools
import inspect
import typing

import pytest

import diptych
from diptych.types import ChatCompletionCreateParams, CompletionCreateParams

USER = [{"role": "user", "content": "Hi"}]


def _is_resource(value: object) -> bool:
    return type(value).__module__.startswith("diptych.resources.")


def _parameter_lists(method: typing.Any) -> list[list[inspect.Parameter]]:
    """The parameters of the method and of each of its overloads."""
    overloads = typing.get_overloads(getattr(method, "__func__", method))
    return [list(inspect.signature(function).parameters.values()) for function in [*overloads, method]]


def signatures(namespace: object, path: str) -> dict[str, list[list[inspect.Parameter]]]:
    """Every public method of `namespace` and of the resources under it, `with_raw_response` included, by path."""
    found = {}
    for name in dir(namespace):
        if name.startswith("_"):
            continue
        value = getattr(namespace, name)
        if _is_resource(value):
            found |= signatures(value, f"{path}.{name}")
        elif inspect.ismethod(value) or inspect.isfunction(value):
            found[f"{path}.{name}"] = _parameter_lists(value)
    return found


async def test_every_call_takes_the_same_parameters_on_the_sync_and_the_async_client():
    with diptych.Client(api_key="k") as client:
        sync = signatures(client, "client")
    async with diptych.AsyncClient(api_key="k") as client:
        async_ = signatures(client, "client")
    assert {
        "client.with_options",
        "client.chat.completions.create",
        "client.chat.completions.with_raw_response.create",
        "client.models.list",
        "client.admin.limits.update_key",
        "client.files.content",
        "client.batches.with_raw_response.cancel",
        "client.files.with_streaming_response.content",
        "client.responses.with_streaming_response.stream",
        "client.admin.api_keys.with_streaming_response.list",
        "client.chat.completions.with_streaming_response.create",
        "client.models.with_streaming_response.list",
    } <= sync.keys()
    options = ["timeout", "extra_headers", "extra_query", "extra_body"]
    for path, parameter_lists in sync.items():  # every call, HTTP or gRPC (the method's own list, after its overloads)
        if path not in ("client.with_options", "client.close"):
            assert set(options) <= {parameter.name for parameter in parameter_lists[-1]}, path
    assert len(sync["client.completions.create"]) == 3  # the two overloads and the method
    assert sync == async_


@pytest.mark.parametrize(
    ("resource", "params"),
    [("completions", CompletionCreateParams), ("chat.completions", ChatCompletionCreateParams)],
)
def test_create_shows_every_parameter_with_its_type_and_default(resource, params):
    with diptych.Client(api_key="k") as client:
        namespace = functools.reduce(getattr, resource.split("."), client)
    parameters = inspect.signature(namespace.create).parameters
    assert sorted(parameters) == sorted(["stream", *params.__annotations__])
    prompt = "messages" if resource.startswith("chat") else "prompt"
    assert list(parameters)[:3] == ["stream", "model", prompt]  # the required ones first
    assert all(parameter.kind is inspect.Parameter.KEYWORD_ONLY for parameter in parameters.values())
    assert (parameters["model"].annotation, parameters["model"].default) == (str, inspect.Parameter.empty)
    assert (parameters["max_tokens"].annotation, parameters["max_tokens"].default) == (int | None, None)
    defaults = {name: parameters[name].default for name in ("priority", "ignore_eos", "stream", "timeout")}
    assert defaults == {"priority": "interactive", "ignore_eos": False, "stream": False, "timeout": None}
    assert inspect.signature(namespace.with_raw_response.create) == inspect.signature(namespace.create)


@pytest.mark.parametrize("arguments", [{"model": "m"}, {"model": "m", "messages": USER, "max_token": 4}])
async def test_a_missing_or_unknown_argument_is_a_type_error_before_sending(server, arguments):
    with diptych.Client(api_key="k", base_url=server.base_url) as client, pytest.raises(TypeError):
        client.chat.completions.create(**arguments)
    async with diptych.AsyncClient(api_key="k", base_url=server.base_url) as client:
        with pytest.raises(TypeError):
            await client.chat.completions.create(**arguments)
    assert server.servicer.requests == []
