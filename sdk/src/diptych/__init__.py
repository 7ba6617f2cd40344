"""Python client for the Diptych LLM serving API."""

from . import types
from ._client import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, AsyncClient, Client
from ._errors import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    DiptychError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
)
from ._streaming import AsyncStream, Stream
from ._version import __version__
from .types import ChatMessageParam, Completion, CompletionChunk, Model, PhaseUsage, Usage

__all__ = [
    "APIConnectionError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatMessageParam",
    "Client",
    "Completion",
    "CompletionChunk",
    "ConflictError",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "DiptychError",
    "InternalServerError",
    "Model",
    "NotFoundError",
    "PermissionDeniedError",
    "PhaseUsage",
    "RateLimitError",
    "ServiceUnavailableError",
    "Stream",
    "Usage",
    "__version__",
    "types",
]
