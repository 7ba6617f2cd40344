"""Stored responses, kept by the control plane (`/api/v1/internal/responses`) so that every gateway finds them:
each call names the organization that owns the response, and another organization's id is answered as none.
"""

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from gateway.openai_api.responses_objects import ResponseRecord

log = logging.getLogger(__name__)

STORE_PATIENCE_S = 15.0  # how long a store rides out an unreachable control plane
STORE_RETRY_S = 0.25


class StoreFailed(Exception):
    """The control plane did not take the response (unreachable for STORE_PATIENCE_S, or it refused it)."""


class ResponseStore:
    def __init__(self, control_plane: ControlPlaneClient) -> None:
        self._control_plane = control_plane

    async def store(self, record: ResponseRecord, create: bool = True) -> str | None:
        """Keeps the record; the status the control plane keeps (a response cancelled meanwhile stays so).
        Without `create` only a response still stored is updated (None when it was deleted meanwhile)."""
        body = {**record_wire(record), "create": create}
        give_up_at = asyncio.get_running_loop().time() + STORE_PATIENCE_S
        while True:
            try:
                status: str | None = (await self._control_plane.store_response(body))["status"]
                return status
            except ControlPlaneUnavailable as error:
                if asyncio.get_running_loop().time() + STORE_RETRY_S > give_up_at:
                    raise StoreFailed(f"the control plane is unreachable: {error}") from None
            except httpx.HTTPStatusError as error:
                raise StoreFailed(f"the control plane refused it: {error.response.text[:300]}") from None
            await asyncio.sleep(STORE_RETRY_S)

    async def fetch(self, organization_id: str, response_id: str) -> ResponseRecord | None:
        found = await self._control_plane.fetch_response(organization_id, response_id)
        return None if found is None else record_from_wire(found)

    async def status(self, organization_id: str, response_id: str) -> str | None:
        return await self._control_plane.response_status(organization_id, response_id)

    async def delete(self, organization_id: str, response_id: str) -> bool:
        return await self._control_plane.delete_response(organization_id, response_id)

    async def cancel(self, organization_id: str, response_id: str) -> ResponseRecord | None:
        found = await self._control_plane.cancel_response(organization_id, response_id)
        return None if found is None else record_from_wire(found)

    async def input_items(
        self, organization_id: str, response_id: str, query: Mapping[str, str]
    ) -> dict[str, Any] | None:
        return await self._control_plane.response_input_items(organization_id, response_id, query)


def record_wire(record: ResponseRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "organization_id": record.organization_id,
        "api_key_id": record.api_key_id,
        "model": record.model,
        "status": record.status,
        "background": bool(record.request.get("background")),
        "request": record.request,
        "metadata": record.metadata,
        "context_items": record.context_items,
        "input_items": record.input_items,
        "output_items": record.output_items,
        "usage": record.usage,
        "error": record.error,
        "incomplete_details": record.incomplete_details,
        "prompt_token_ids": record.prompt_token_ids,
        "output_token_ids": record.output_token_ids,
        "created_at": record.created_at,
        "completed_at": record.completed_at,
    }


def record_from_wire(body: dict[str, Any]) -> ResponseRecord:
    return ResponseRecord(
        id=body["id"],
        organization_id=body["organization_id"],
        api_key_id=body["api_key_id"],
        model=body["model"],
        request=body["request"],
        metadata=body["metadata"],
        context_items=body["context_items"],
        input_items=body["input_items"],
        prompt_token_ids=body["prompt_token_ids"],
        status=body["status"],
        created_at=body["created_at"],
        completed_at=body["completed_at"],
        output_items=body["output_items"],
        output_token_ids=body["output_token_ids"],
        usage=body["usage"],
        error=body["error"],
        incomplete_details=body["incomplete_details"],
    )
