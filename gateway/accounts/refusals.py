"""Requests refused by a rate limit, counted per minute, API key and limit, and reported to the control plane
in batches, beside usage, so that a customer can see why they were refused (GET /api/v1/rate-limit-refusals).

Counting a refusal is one dictionary update in memory: a flood of refused requests costs the gateway nothing
more, and makes one row per key, limit and minute. The reporter sends the counts every flush interval; a row
keeps its id until the control plane acknowledged it, so that a batch sent again after a lost answer counts
once. The counts live in memory only: a gateway killed outright loses the refusals of its last interval
(unlike usage, which is billed and journaled, see usage.py).
"""

import datetime
import logging
import uuid
from dataclasses import dataclass

from diptych_common.internal_api.client import ControlPlaneClient
from diptych_common.internal_api.messages import RefusalReport
from gateway.accounts.usage import flush_forever

log = logging.getLogger(__name__)

BATCH_SIZE = 500
FLUSH_INTERVAL_S = 1.0
# The bucket's (scope, kind) as limits.py names them, as the control plane names them.
SCOPES = {"organization": "organization", "project": "project", "API key": "api_key"}
LIMITS = {
    "requests": "requests_per_minute",
    "input tokens": "input_tokens_per_minute",
    "output tokens": "output_tokens_per_minute",
}


@dataclass(frozen=True)
class RefusalKey:
    organization_id: str
    api_key_id: str
    scope: str  # "organization", "project" or "api_key"
    limit: str  # e.g. "requests_per_minute"
    limit_value: int
    minute: datetime.datetime


def this_minute() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(second=0, microsecond=0)


class RefusalTally:
    """Refused requests counted in memory; `take` hands the counts over as rows with ids, each row kept
    (and sent again by the same id) until `acknowledge` says the control plane stored it."""

    def __init__(self) -> None:
        self._counts: dict[RefusalKey, int] = {}
        self._unacknowledged: list[RefusalReport] = []

    def record(self, organization_id: str, api_key_id: str, scope: str, kind: str, limit_value: int) -> None:
        """One request refused by the `scope` limit (limits.py's "organization", "project" or "API key") on
        `kind`."""
        key = RefusalKey(organization_id, api_key_id, SCOPES[scope], LIMITS[kind], limit_value, this_minute())
        self._counts[key] = self._counts.get(key, 0) + 1

    def take(self, limit: int = BATCH_SIZE) -> list[RefusalReport]:
        """Up to `limit` rows for the control plane: those not acknowledged yet first, then the new counts."""
        counts, self._counts = self._counts, {}
        self._unacknowledged += [_row(key, refusals) for key, refusals in counts.items()]
        return self._unacknowledged[:limit]

    def acknowledge(self, rows: list[RefusalReport]) -> None:
        sent = {row.id for row in rows}
        self._unacknowledged = [row for row in self._unacknowledged if row.id not in sent]

    @property
    def pending(self) -> int:
        return len(self._unacknowledged) + len(self._counts)


def _row(key: RefusalKey, refusals: int) -> RefusalReport:
    return RefusalReport(
        id=uuid.uuid4().hex,
        organization_id=key.organization_id,
        api_key_id=key.api_key_id,
        scope=key.scope,
        limit=key.limit,
        limit_value=key.limit_value,
        minute=key.minute.isoformat(),
        refusals=refusals,
    )


class RefusalReporter:
    """Sends the tally's rows to the control plane; a row leaves only once acknowledged."""

    def __init__(self, control_plane: ControlPlaneClient, tally: RefusalTally) -> None:
        self._control_plane = control_plane
        self.tally = tally

    @property
    def pending(self) -> int:
        return self.tally.pending

    async def flush(self) -> None:
        while rows := self.tally.take():
            await self._control_plane.post_rate_limit_refusals(rows)
            self.tally.acknowledge(rows)

    async def flush_forever(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        await flush_forever(self, "rate-limit refusals", interval_s)
