"""The OpenAPI schema: every operation documents the one error shape as its default response, and every POST
that honours Idempotency-Key documents the header."""

import threading
from functools import cache

from drf_spectacular import openapi
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import OpenApiParameter

from controlplane.common import idempotency
from controlplane.common.idempotency import IdempotentPostMixin

ERROR_COMPONENT = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string", "description": "Stable machine-readable kind, e.g. validation_error."},
                "message": {"type": "string", "description": "What went wrong and what to change."},
                "fields": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "string"}},
                    "description": "Problems per input field (paths such as events[3].phase).",
                },
            },
        }
    },
}
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options"}


def document_error_responses(result: dict, generator, request, public: bool) -> dict:
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_COMPONENT
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method in HTTP_METHODS:
                operation.setdefault("responses", {}).setdefault(
                    "default",
                    {
                        "description": "Any error, in the one error shape.",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                    },
                )
    return result


class AutoSchema(openapi.AutoSchema):
    """Documents the Idempotency-Key header on every POST of a view that honours it, and a body that must
    name a field as required."""

    def _get_request_body(self, direction="request"):
        """A body that must name a field (StrictInputSerializer.requires_a_field) must be sent at all."""
        body = super()._get_request_body(direction)
        if body and getattr(self.get_request_serializer(), "requires_a_field", False):
            body["required"] = True
        return body

    def get_override_parameters(self) -> list:
        parameters = list(super().get_override_parameters())
        if self.method == "POST" and isinstance(self.view, IdempotentPostMixin):
            parameters.append(IDEMPOTENCY_KEY_PARAMETER)
        return parameters


class StrictInputSerializerExtension(OpenApiSerializerExtension):
    """A StrictInputSerializer refuses fields it does not declare, and one that `requires_a_field` an empty
    body: its schema says so, so that a body the schema calls valid is never refused for either."""

    target_class = "controlplane.common.strict_input.StrictInputSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema, direction) -> dict:
        schema = auto_schema._map_basic_serializer(self.target, direction)
        schema["additionalProperties"] = False
        if self.target.requires_a_field:
            schema["minProperties"] = 1
        return schema


IDEMPOTENCY_KEY_PARAMETER = OpenApiParameter(
    name=idempotency.HEADER,
    type={"type": "string", "minLength": 1, "maxLength": idempotency.MAX_KEY_LENGTH, "pattern": "^[ -~]+$"},
    location=OpenApiParameter.HEADER,
    required=False,
    description="Makes a retry safe: the first successful response is stored for 24 hours and a retry with "
    "the same key and the same request gets it back (with `Idempotent-Replayed: true`) instead of acting "
    "twice. The same key with another request: 400; while the first is still running: 409.",
)


# drf-spectacular loads its extensions' target classes lazily and not thread-safely: two schemas built at
# once in a fresh process (the dashboard's first sections, loading side by side) can fail one with an
# AttributeError. Every schema is built under this lock.
SCHEMA_GENERATION = threading.Lock()


def full_schema() -> dict:
    """The schema of every endpoint, the internal ones included, as the public schema view would build it."""
    with SCHEMA_GENERATION:
        return _full_schema()


@cache
def _full_schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)
