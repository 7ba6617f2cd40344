"""The public Inference service over gRPC: maps the contract's messages into the pipeline's types and its
outputs and errors back, nothing more.

Each RPC parses its own request (`add_inference_service`): grpc.aio answers a request its deserializer
cannot parse with UNKNOWN, while malformed protobuf (corrupt wire format, invalid UTF-8 in a string
field) is the client's error and gets INVALID_ARGUMENT saying so.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.core.pipeline import Pipeline
from gateway.metrics import count_request, timed_request
from gateway.planning.tokenization import tokenizer_for
from gateway.types import (
    ChatMessage,
    ErrorKind,
    FinishReason,
    GatewayError,
    GenerationOutput,
    GenerationRequest,
    PhaseUsage,
    ResponseFormat,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
    Usage,
    as_told,
)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
_STATUS = {kind: grpc.StatusCode[kind.value] for kind in ErrorKind}  # each kind is the status of its name
_FINISH_REASON = {
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.INTERRUPTED: inference_pb2.FINISH_REASON_INTERRUPTED,
    FinishReason.TOOL_CALLS: inference_pb2.FINISH_REASON_TOOL_CALLS,
}


class MalformedRequest:
    """What a request deserializer returns for bytes that are not the message it expects."""

    def __init__(self, message_name: str, reason: str) -> None:
        self.message_name = message_name
        self.reason = reason

    def description(self) -> str:
        return (
            f"the request is not a valid {self.message_name} ({self.reason}); "
            f"send a serialized {self.message_name.rsplit('.', 1)[-1]} whose strings are valid UTF-8"
        )


def request_parser(message_class: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    def parse(raw: bytes) -> Message | MalformedRequest:
        try:
            return message_class.FromString(raw)
        except DecodeError as error:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, str(error))

    return parse


def add_inference_service(server: grpc.aio.Server, pipeline: Pipeline) -> None:
    """Registers the Inference service as the generated helper does, with each RPC's own parser."""
    service = InferenceService(pipeline)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=request_parser(inference_pb2.GenerateRequest),
            response_serializer=inference_pb2.GenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=request_parser(inference_pb2.ListModelsRequest),
            response_serializer=inference_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def Generate(
        self,
        request: inference_pb2.GenerateRequest | MalformedRequest,
        context: grpc.aio.ServicerContext[
            inference_pb2.GenerateRequest | MalformedRequest, inference_pb2.GenerateResponse
        ],
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        with timed_request("grpc") as record:
            if isinstance(request, MalformedRequest):  # refused before the pipeline saw it: counted here
                count_request("", "", ErrorKind.INVALID_ARGUMENT.value, "grpc")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.description())
                return  # abort raises
            request_id, executing = request.request_id, False
            try:
                admitted = await self._pipeline.admit(
                    _authorization(context), generation_request(request), "grpc", context.peer()
                )
                request_id, executing = admitted.execution_id, True
                try:
                    await context.send_initial_metadata(admitted.response_metadata)
                    async with aclosing(self._pipeline.generate(admitted)) as outputs:
                        async for output in outputs:
                            yield generate_response(output)
                finally:
                    self._pipeline.abandon(admitted)  # frees what it holds if it never ran (the client left first)
                record.outcome = record.outcome or "OK"  # an idempotent replay, answered without running
            except GatewayError as error:
                await _abort(context, as_told(error, request_id) if executing else error, request_id)

    async def ListModels(
        self,
        request: inference_pb2.ListModelsRequest | MalformedRequest,
        context: grpc.aio.ServicerContext[
            inference_pb2.ListModelsRequest | MalformedRequest, inference_pb2.ListModelsResponse
        ],
    ) -> inference_pb2.ListModelsResponse:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.description())
        try:
            _, limits = await self._pipeline.authenticate(_authorization(context), context.peer())
        except GatewayError as error:
            await _abort(context, error, "")
        await context.send_initial_metadata(limits)
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.Model(
                    id=model.name,
                    context_length=model.context_length,
                    has_chat_template=bool(tokenizer_for(model.source).chat_template),
                )
                for model in self._pipeline.registry.models.values()
            ]
        )


def generation_request(message: inference_pb2.GenerateRequest) -> GenerationRequest:
    """The contract's request as the gateway's own: an optional field the client left unset is None."""
    given = message.WhichOneof("input")
    return GenerationRequest(
        model=message.model,
        prompt=message.prompt if given == "prompt" else None,
        prompt_token_ids=list(message.prompt_token_ids.ids) if given == "prompt_token_ids" else None,
        chat=[_chat_message(m) for m in message.chat.messages] if given == "chat" else None,
        max_tokens=message.max_tokens if message.HasField("max_tokens") else None,
        temperature=message.temperature if message.HasField("temperature") else None,
        top_p=message.top_p if message.HasField("top_p") else None,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=list(message.stop),
        client_request_id=message.request_id,
        idempotency_key=message.idempotency_key,
        resume_request_id=message.resume_request_id,
        priority=message.priority,
        ignore_eos=message.ignore_eos,
        n=message.n if message.HasField("n") else None,
        prompt_cache_key=message.prompt_cache_key,
        presence_penalty=message.presence_penalty if message.HasField("presence_penalty") else None,
        frequency_penalty=message.frequency_penalty if message.HasField("frequency_penalty") else None,
        logit_bias=dict(message.logit_bias) or None,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs if message.HasField("top_logprobs") else None,
        **_structured_fields(message),
    )


def _chat_message(message: inference_pb2.ChatMessage) -> ChatMessage:
    calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in message.tool_calls)
    return ChatMessage(message.role, message.content, calls, message.tool_call_id)


def _structured_fields(message: inference_pb2.GenerateRequest) -> dict[str, Any]:
    """response_format, tools, tool_choice and parallel_tool_calls, where the client set them."""
    fields: dict[str, Any] = {
        "tools": tuple(Tool(t.name, t.description, t.parameters, t.strict) for t in message.tools)
    }
    if message.HasField("response_format"):
        given = message.response_format
        fields["response_format"] = ResponseFormat(given.type or "text", given.json_schema, given.name, given.strict)
    if message.HasField("tool_choice"):
        choice = message.tool_choice
        if choice.mode or choice.function_name:
            fields["tool_choice"] = ToolChoice(choice.mode or "function", choice.function_name)
        if choice.HasField("parallel_tool_calls"):
            fields["parallel_tool_calls"] = choice.parallel_tool_calls
    return fields


def generate_response(output: GenerationOutput) -> inference_pb2.GenerateResponse:
    response = inference_pb2.GenerateResponse(
        request_id=output.request_id, text=output.text, token_ids=output.token_ids, index=output.index
    )
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASON[output.finish_reason]
    if output.usage is not None:
        response.usage.CopyFrom(_usage(output.usage))
    for entry in output.logprobs or ():
        response.logprobs.append(_token_logprob(entry))
    for call in output.tool_calls:
        response.tool_calls.append(inference_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments))
    return response


def _token_logprob(entry: TokenLogprob) -> inference_pb2.TokenLogprob:
    return inference_pb2.TokenLogprob(
        token_id=entry.token_id,
        token=entry.token,
        logprob=entry.logprob,
        top_logprobs=[
            inference_pb2.TopLogprob(token_id=top.token_id, token=top.token, logprob=top.logprob)
            for top in entry.top_logprobs
        ],
    )


def _usage(usage: Usage) -> inference_pb2.Usage:
    return inference_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        prefill=_phase_usage(usage.prefill),
        decode=_phase_usage(usage.decode),
    )


def _phase_usage(phase: PhaseUsage | None) -> inference_pb2.PhaseUsage | None:
    if phase is None:
        return None
    return inference_pb2.PhaseUsage(
        tokens=phase.tokens,
        cached_tokens=phase.cached_tokens,
        kv_bytes=phase.kv_bytes,
        compute_ms=phase.compute_ms,
        worker_id=phase.worker_id,
    )


def _authorization(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: GatewayError, request_id: str) -> None:
    metadata: list[tuple[str, str]] = []
    if request_id:
        metadata.append(("request-id", request_id))
    if error.retry_after_ms is not None:
        metadata.append(("retry-after-ms", str(error.retry_after_ms)))
    metadata.extend(error.rate_limit_metadata)
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(_STATUS[error.kind], error.message)
