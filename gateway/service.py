"""The public Inference service over gRPC: translates to and from the pipeline, nothing more.

Generate parses its own request (`add_inference_service`): grpc.aio answers a request its deserializer
cannot parse with UNKNOWN, while malformed protobuf (corrupt wire format, invalid UTF-8 in a string
field) is the client's error and gets INVALID_ARGUMENT saying so.
"""

from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError

from diptych._proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.errors import GatewayError
from gateway.pipeline import Pipeline
from gateway.tokenization import tokenizer_for

SERVICE_NAME = "diptych.v1.Inference"


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
            admitted = await self._pipeline.admit(_authorization(context), request, "grpc", context.peer())
            request_id = admitted.execution_id
            await context.send_initial_metadata(admitted.response_metadata)
            async with aclosing(self._pipeline.generate(admitted)) as responses:
                async for response in responses:
                    yield response
        except GatewayError as error:
            await _abort(context, error, request_id)

    async def ListModels(self, request, context):
        try:
            await self._pipeline.auth.authenticate_header(_authorization(context), context.peer())
        except GatewayError as error:
            await _abort(context, error, "")
        return inference_pb2.ListModelsResponse(models=[
            inference_pb2.Model(
                id=model.name, context_length=model.context_length,
                has_chat_template=bool(tokenizer_for(model.source).chat_template),
            )
            for model in self._pipeline.registry.models.values()
        ])


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
    await context.abort(error.code, error.message)
