"""Schema post-processing: every operation documents the one error shape as its default response."""

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
