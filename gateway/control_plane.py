"""The gateway's calls to the control plane's internal REST API."""

import httpx


class ControlPlaneUnavailable(Exception):
    pass


class ControlPlaneClient:
    def __init__(self, base_url: str, internal_token: str, timeout: float = 5.0) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {internal_token}"},
            timeout=timeout,
        )

    async def verify_api_key(self, api_key: str) -> dict | None:
        """The key's identity ({api_key_id, organization_id}), or None when the control plane refuses it."""
        response = await self._request("POST", "/api/v1/internal/api-keys/verify", json={"api_key": api_key})
        if response.status_code == 401:
            return None
        response.raise_for_status()
        return response.json()

    async def registry(self) -> dict:
        response = await self._request("GET", "/api/v1/internal/registry")
        response.raise_for_status()
        return response.json()

    async def worker_rpc_secret(self) -> str:
        """What every call to a worker carries (`authorization: Bearer <secret>`)."""
        response = await self._request("GET", "/api/v1/internal/worker-credential")
        response.raise_for_status()
        return response.json()["worker_rpc_secret"]

    async def post_usage_events(self, events: list[dict], headers: dict[str, str] | None = None) -> dict:
        """`headers`: a `traceparent` naming the usage.ingest span, when the batch is traced."""
        response = await self._request(
            "POST", "/api/v1/internal/usage-events", json={"events": events}, headers=headers or {}
        )
        response.raise_for_status()
        return response.json()

    async def post_rate_limit_refusals(self, refusals: list[dict]) -> dict:
        return await self._post_json("/api/v1/internal/rate-limit-refusals", {"refusals": refusals})

    async def claim_idempotency_key(self, body: dict) -> dict:
        return await self._post_json("/api/v1/internal/idempotency-keys/claim", body)

    async def complete_idempotency_key(self, body: dict) -> dict:
        return await self._post_json("/api/v1/internal/idempotency-keys/complete", body)

    async def release_idempotency_key(self, body: dict) -> dict:
        return await self._post_json("/api/v1/internal/idempotency-keys/release", body)

    async def _post_json(self, path: str, body: dict) -> dict:
        response = await self._request("POST", path, json=body)
        response.raise_for_status()
        return response.json()

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise ControlPlaneUnavailable(f"control plane unreachable: {error!r}") from error
        if response.status_code >= 500:
            raise ControlPlaneUnavailable(f"control plane answered {response.status_code} to {method} {path}")
        return response

    async def close(self) -> None:
        await self._http.aclose()
