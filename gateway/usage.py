"""Usage events: one per request and phase, sent to the control plane in batches. The control plane
deduplicates on (request id, phase), so a batch that is sent again after a lost answer counts once."""

import asyncio
import logging

from gateway.control_plane import ControlPlaneClient

log = logging.getLogger(__name__)

BATCH_SIZE = 500


class UsageReporter:
    def __init__(self, control_plane: ControlPlaneClient, flush_interval_s: float = 0.1) -> None:
        self._control_plane = control_plane
        self._flush_interval_s = flush_interval_s
        self._pending: list[dict] = []

    def record(self, events: list[dict]) -> None:
        self._pending.extend(events)

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> None:
        """Sends what is pending; on failure the events stay pending for the next flush."""
        while self._pending:
            batch = self._pending[:BATCH_SIZE]
            await self._control_plane.post_usage_events(batch)
            del self._pending[: len(batch)]

    async def flush_forever(self) -> None:
        backoff = self._flush_interval_s
        while True:
            await asyncio.sleep(backoff)
            try:
                await self.flush()
                backoff = self._flush_interval_s
            except Exception as error:  # keep every event; try again later
                backoff = min(backoff * 2, 5.0)
                log.warning("cannot send %d usage events yet: %r", len(self._pending), error)
