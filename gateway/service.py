"""The public Inference service over gRPC: translates to and from the pipeline, nothing more."""

from contextlib import aclosing

from diptych._proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.errors import GatewayError
from gateway.pipeline import Pipeline
from gateway.tokenization import tokenizer_for


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def Generate(self, request, context):
        request_id = request.request_id
        try:
            admitted = await self._pipeline.admit(_authorization(context), request, "grpc")
            request_id = admitted.plan.request_id
            async with aclosing(self._pipeline.generate(admitted)) as responses:
                async for response in responses:
                    yield response
        except GatewayError as error:
            await _abort(context, error, request_id)

    async def ListModels(self, request, context):
        try:
            await self._pipeline.auth.authenticate_header(_authorization(context))
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
            return value
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
