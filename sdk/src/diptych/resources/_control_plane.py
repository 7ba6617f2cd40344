"""What the control plane's resources (admin, files, batches) share: a call over its HTTP transport with
the client's options of the moment, and a response parsed from its JSON body."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .._http import json_body
from .._response import StreamedAPIResponse
from ..types import PostRequestOptions, RequestOptions
from ._connections import ControlPlaneConnection

T = TypeVar("T")


def from_json(convert: Callable[[object], T]) -> Callable[[StreamedAPIResponse[Any]], T]:
    """A response parser: the JSON body, converted."""
    return lambda response: convert(json_body(response))


class ControlPlaneResource:
    def __init__(self, client: ControlPlaneConnection) -> None:
        self._client = client

    def _request(
        self,
        method: str,
        path: str,
        parse: Callable[[StreamedAPIResponse[Any]], T],
        options: RequestOptions | PostRequestOptions,
        *,
        query: Mapping[str, object] | None = None,
        body: object = None,
        content: tuple[bytes, str] | None = None,
    ) -> T:
        client = self._client
        return client._admin_transport.request(
            method,
            path,
            parse=parse,
            query=query,
            body=body,
            content=content,
            options=options,
            timeout=client.timeout,
            max_retries=client.max_retries,
        )
