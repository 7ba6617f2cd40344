"""A scripted in-process Inference server: real gRPC on loopback, with responses the test decides.

It is not the gateway; it lets the SDK's own claims (metadata, retries, cancellation,
error mapping of real statuses) be checked over a real channel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from diptych_proto.v1 import inference_pb2 as pb
from diptych_proto.v1 import inference_pb2_grpc as pb_grpc

Handler = Callable[[pb.GenerateRequest, grpc.ServicerContext], Iterator[pb.GenerateResponse]]


def request_id_of(request: pb.GenerateRequest) -> str:
    """Like the gateway, names the request after its idempotency key."""
    return f"req_{request.idempotency_key.replace('-', '')[:24]}"


def final_usage() -> pb.Usage:
    return pb.Usage(
        prompt_tokens=5,
        completion_tokens=2,
        cached_tokens=1,
        prefill=pb.PhaseUsage(tokens=5, cached_tokens=1, kv_bytes=4096, compute_ms=12, worker_id="prefill-0"),
        decode=pb.PhaseUsage(tokens=2, kv_bytes=0, compute_ms=30, worker_id="decode-0"),
    )


def tokens(
    *deltas: tuple[str, list[int]],
    finish: int = pb.FINISH_REASON_STOP,
    initial_metadata: tuple[tuple[str, str], ...] | None = None,
) -> Handler:
    """Streams the deltas; the last one carries finish_reason and usage. With `initial_metadata`, the call
    first sends it after the request id, as the gateway sends the request id and the rate limits."""

    def handler(request, context):
        if initial_metadata is not None:
            context.send_initial_metadata((("request-id", request_id_of(request)), *initial_metadata))
        for index, (text, ids) in enumerate(deltas):
            message = pb.GenerateResponse(request_id=request_id_of(request), text=text, token_ids=ids)
            if index == len(deltas) - 1:
                message.finish_reason = finish
                message.usage.CopyFrom(final_usage())
            yield message

    return handler


def fail(code: grpc.StatusCode, details: str = "scripted failure", trailers=(), after: int = 0) -> Handler:
    """Streams `after` deltas without finishing, then ends the call with `code`."""

    def handler(request, context):
        for index in range(after):
            yield pb.GenerateResponse(request_id=request_id_of(request), text=f"t{index}", token_ids=[index])
        context.set_trailing_metadata((("request-id", request_id_of(request)), *trailers))
        context.abort(code, details)

    return handler


def stored(text: str, ids: list[int], finish: int = pb.FINISH_REASON_INTERRUPTED) -> Handler:
    """A replay of what the execution `resume_request_id` names stored under the key: one message."""

    def handler(request, context):
        message = pb.GenerateResponse(request_id=request.resume_request_id, text=text, token_ids=ids)
        message.finish_reason = finish
        message.usage.CopyFrom(final_usage())
        yield message

    return handler


def unfinished(request, context):
    yield pb.GenerateResponse(request_id=request_id_of(request), text="partial", token_ids=[1])


def final_without_usage(request, context):
    yield pb.GenerateResponse(request_id=request_id_of(request), text="x", finish_reason=pb.FINISH_REASON_STOP)


def endless(request, context):
    while context.is_active():
        yield pb.GenerateResponse(request_id=request_id_of(request), text="x", token_ids=[7])
        time.sleep(0.01)  # a token every 10 ms, as a generating worker paces a stream


def silent_after(count: int) -> Handler:
    """Streams `count` deltas, then sends nothing more until the client gives up."""

    def handler(request, context):
        for index in range(count):
            yield pb.GenerateResponse(request_id=request_id_of(request), text=f"t{index}", token_ids=[index])
        while context.is_active():  # silent, until the client ends the call
            time.sleep(0.01)

    return handler


@dataclass
class ScriptedInference(pb_grpc.InferenceServicer):
    script: list[Handler] = field(default_factory=list)  # one handler per call; the last one repeats
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    call_ended: threading.Event = field(default_factory=threading.Event)
    models: list[pb.Model] = field(default_factory=list)
    models_metadata: tuple[tuple[str, str], ...] = ()  # ListModels' initial metadata

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        context.add_callback(self.call_ended.set)
        handler = self.script[min(len(self.requests), len(self.script)) - 1]
        yield from handler(request, context)

    def ListModels(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        if self.models_metadata:
            context.send_initial_metadata(self.models_metadata)
        return pb.ListModelsResponse(models=self.models)


@dataclass
class Server:
    servicer: ScriptedInference
    base_url: str
