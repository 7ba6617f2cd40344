"""The client of the internal API: one method per endpoint, over HTTP with a bearer token (the internal
token, or a worker's fleet token). `ControlPlaneClient` is asynchronous (the gateway, the workers, the KV
tier); `SyncControlPlaneClient` blocks (a worker's model manifest before it starts, `diptych model register`).

A call raises ControlPlaneUnavailable when the control plane cannot be reached or fails (5xx), and
httpx.HTTPStatusError when it refuses the call (4xx), unless its method says otherwise.
"""

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from diptych_common.internal_api import endpoints
from diptych_common.internal_api.endpoints import Endpoint
from diptych_common.internal_api.messages import ModelRegistration, RefusalReport, RegisteredModel, UsageEvent
from diptych_common.logs import describe_error


class ControlPlaneUnavailable(httpx.HTTPError):
    """The control plane did not answer, or failed; an httpx.HTTPError, so that a caller retrying any
    failed call retries this one too."""


def describe_failure(error: httpx.HTTPError) -> str:
    """What a failed call met: the connection's error when the control plane was not reached."""
    return describe_error(error.__cause__ or error)


class ControlPlaneClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=_bearer(token), timeout=timeout, transport=transport
        )

    # ---- the gateway's ---------------------------------------------------------------------------------

    async def verify_api_key(self, api_key: str) -> dict[str, Any] | None:
        """The key's identity ({api_key_id, organization_id}), or None when the control plane refuses it."""
        response = await self._request(endpoints.API_KEY_VERIFY, json={"api_key": api_key})
        if response.status_code == 401:
            return None
        return _body(response)

    async def registry(self) -> dict[str, Any]:
        return _body(await self._request(endpoints.REGISTRY))

    async def worker_rpc_secret(self) -> str:
        """What every call to a worker carries (`authorization: Bearer <secret>`)."""
        secret: str = _body(await self._request(endpoints.WORKER_CREDENTIAL))["worker_rpc_secret"]
        return secret

    async def post_usage_events(
        self, events: Sequence[UsageEvent], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """`headers`: a `traceparent` naming the usage.ingest span, when the batch is traced."""
        body = {"events": [event.to_wire() for event in events]}
        return _body(await self._request(endpoints.USAGE_EVENTS, json=body, headers=headers or {}))

    async def post_rate_limit_refusals(self, refusals: Sequence[RefusalReport]) -> dict[str, Any]:
        body = {"refusals": [refusal.to_wire() for refusal in refusals]}
        return _body(await self._request(endpoints.RATE_LIMIT_REFUSALS, json=body))

    async def claim_idempotency_key(self, body: dict[str, Any]) -> dict[str, Any]:
        return _body(await self._request(endpoints.IDEMPOTENCY_KEY_CLAIM, json=body))

    async def complete_idempotency_key(self, body: dict[str, Any]) -> dict[str, Any]:
        return _body(await self._request(endpoints.IDEMPOTENCY_KEY_COMPLETE, json=body))

    async def release_idempotency_key(self, body: dict[str, Any]) -> dict[str, Any]:
        return _body(await self._request(endpoints.IDEMPOTENCY_KEY_RELEASE, json=body))

    # Stored responses (`/v1/responses`), each call naming the organization that owns the response: another
    # organization's id is answered as none (None, False).

    async def store_response(self, body: dict[str, Any]) -> dict[str, Any]:
        """Creates or updates a stored response; the answer holds its status as kept (a cancel stays)."""
        return _body(await self._request(endpoints.RESPONSE_STORE, json=body))

    async def fetch_response(self, organization_id: str, response_id: str) -> dict[str, Any] | None:
        return _found(await self._response_call(endpoints.RESPONSE_FETCH, organization_id, response_id))

    async def response_status(self, organization_id: str, response_id: str) -> str | None:
        found = _found(await self._response_call(endpoints.RESPONSE_STATUS, organization_id, response_id))
        if found is None:
            return None
        status: str = found["status"]
        return status

    async def delete_response(self, organization_id: str, response_id: str) -> bool:
        return _found(await self._response_call(endpoints.RESPONSE_DELETE, organization_id, response_id)) is not None

    async def cancel_response(self, organization_id: str, response_id: str) -> dict[str, Any] | None:
        """The response after the cancel; httpx.HTTPStatusError (400) when it cannot be cancelled."""
        response = await self._request(
            endpoints.RESPONSE_CANCEL, {"response_id": response_id}, json={"organization_id": organization_id}
        )
        return _found(response)

    async def response_input_items(
        self, organization_id: str, response_id: str, query: Mapping[str, str]
    ) -> dict[str, Any] | None:
        """A page of the response's input items; httpx.HTTPStatusError (400) for a query it refuses."""
        return _found(await self._response_call(endpoints.RESPONSE_INPUT_ITEMS, organization_id, response_id, query))

    async def _response_call(
        self, endpoint: Endpoint, organization_id: str, response_id: str, query: Mapping[str, str] | None = None
    ) -> httpx.Response:
        params = {**(query or {}), "organization_id": organization_id}
        return await self._request(endpoint, {"response_id": response_id}, params=params)

    # ---- the workers' ----------------------------------------------------------------------------------

    async def register_worker(self, *, address: str, name: str, revision: str) -> dict[str, Any]:
        body = {"address": address, "name": name, "revision": revision}
        return _body(await self._request(endpoints.WORKER_REGISTER, json=body))

    async def heartbeat(self, worker_id: str, state: str, load: Mapping[str, Any]) -> dict[str, Any]:
        body = {"state": state, **load}
        return _body(await self._request(endpoints.WORKER_HEARTBEAT, {"worker_id": worker_id}, json=body))

    async def _request(
        self, endpoint: Endpoint, parameters: Mapping[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        path = endpoint.url(**(parameters or {}))
        try:
            response = await self._http.request(endpoint.method, path, **kwargs)
        except httpx.TransportError as error:
            raise ControlPlaneUnavailable(f"control plane unreachable: {error!r}") from error
        return _unless_failed(response)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()


class SyncControlPlaneClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        timeout: float | httpx.Timeout = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=_bearer(token), timeout=timeout, transport=transport
        )

    def artifact_manifest(self) -> dict[str, Any]:
        """The manifest of the calling fleet's model (with its fleet token)."""
        return _body(self._request(endpoints.ARTIFACT_MANIFEST))

    def model_artifact_manifest(self, model: str) -> dict[str, Any]:
        """The manifest of any model (with the internal token)."""
        return _body(self._request(endpoints.MODEL_ARTIFACT_MANIFEST, {"model": model}))

    def register_model(self, registration: ModelRegistration, directory: Path) -> RegisteredModel:
        """Sends the registration with the file at each of its paths under `directory` (with the internal
        token); the control plane answers once every file is hashed and stored."""
        with ExitStack() as opened:
            files = [
                ("files", (path, opened.enter_context((directory / path).open("rb")))) for path in registration.paths
            ]
            response = self._request(endpoints.MODEL_REGISTER, data=registration.to_wire(), files=files)
        return RegisteredModel.from_wire(_body(response))

    def _request(
        self, endpoint: Endpoint, parameters: Mapping[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        path = endpoint.url(**(parameters or {}))
        try:
            response = self._http.request(endpoint.method, path, **kwargs)
        except httpx.TransportError as error:
            raise ControlPlaneUnavailable(f"control plane unreachable: {error!r}") from error
        return _unless_failed(response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _unless_failed(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 500:
        request = response.request
        raise ControlPlaneUnavailable(
            f"control plane answered {response.status_code} to {request.method} {request.url.path}"
        )
    return response


def _found(response: httpx.Response) -> dict[str, Any] | None:
    """The JSON answer, or None when the control plane answered 404."""
    return None if response.status_code == 404 else _body(response)


def _body(response: httpx.Response) -> dict[str, Any]:
    """The JSON answer; httpx.HTTPStatusError when the control plane refused the call."""
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer
