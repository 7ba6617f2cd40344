"""The public Inference service over gRPC: maps the contract's messages into the pipeline's types and its
outputs and errors back, nothing more.

Generate parses its own request (`add_inference_service`): grpc.aio answers a request its deserializer
cannot parse with UNKNOWN, while malformed protobuf (corrupt wire format, invalid UTF-8 in a string
field) is the client's error and gets INVALID_ARGUMENT saying so.
"""

from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.pipeline import Pipeline
from gateway.tokenization import tokenizer_for
from gateway.types import (
    ChatMessage,
    ErrorKind,
    FinishReason,
    GatewayError,
    GenerationOutput,
    GenerationRequest,
    PhaseUsage,
    Usage,
)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
_STATUS = {kind: grpc.StatusCode[kind.value] for kind in ErrorKind}  # each kind is the status of its name
_FINISH_REASON = {
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
}


class MalformedRequest:
    """What the Generate deserializer returns for bytes that are not a GenerateRequest."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def parse_generate_request(raw: bytes) -> inference_pb2.GenerateRequest | MalformedRequest:
    try:
        return inference_pb2.GenerateRequest.FromString(raw)
    except DecodeError as error:
        return MalformedRequest(str(error))


def add_inference_service(server: grpc.aio.Server, pipeline: Pipeline) -> None:
    """Registers the Inference service as the generated helper does, with Generate's own parser."""
    service = InferenceService(pipeline)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=parse_generate_request,
            response_serializer=inference_pb2.GenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=inference_pb2.ListModelsRequest.FromString,
            response_serializer=inference_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def Generate(self, request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid diptych.v1.GenerateRequest ({request.reason}); "
                "send a serialized GenerateRequest whose strings are valid UTF-8",
            )
        request_id = request.request_id
        try:
            admitted = await self._pipeline.admit(
                _authorization(context), generation_request(request), "grpc", context.peer()
            )
            request_id = admitted.execution_id
            await context.send_initial_metadata(admitted.response_metadata)
            async with aclosing(self._pipeline.generate(admitted)) as outputs:
                async for output in outputs:
                    yield generate_response(output)
        except GatewayError as error:
            await _abort(context, error, request_id)

    async def ListModels(self, request, context):
        try:
            await self._pipeline.auth.authenticate_header(_authorization(context), context.peer())
        except GatewayError as error:
            await _abort(context, error, "")
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
        chat=[ChatMessage(m.role, m.content) for m in message.chat.messages] if given == "chat" else None,
        max_tokens=message.max_tokens if message.HasField("max_tokens") else None,
        temperature=message.temperature if message.HasField("temperature") else None,
        top_p=message.top_p if message.HasField("top_p") else None,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=list(message.stop),
        client_request_id=message.request_id,
        idempotency_key=message.idempotency_key,
        priority=message.priority,
        ignore_eos=message.ignore_eos,
    )


def generate_response(output: GenerationOutput) -> inference_pb2.GenerateResponse:
    response = inference_pb2.GenerateResponse(
        request_id=output.request_id, text=output.text, token_ids=output.token_ids
    )
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASON[output.finish_reason]
    if output.usage is not None:
        response.usage.CopyFrom(_usage(output.usage))
    return response


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


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


async def _abort(context, error: GatewayError, request_id: str) -> None:
    metadata = []
    if request_id:
        metadata.append(("request-id", request_id))
    if error.retry_after_ms is not None:
        metadata.append(("retry-after-ms", str(error.retry_after_ms)))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(_STATUS[error.kind], error.message)
