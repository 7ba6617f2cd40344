"""Idempotency keys the gateway holds alone while the control plane cannot be reached, handed over once it
can be.

A gateway cut off from the control plane goes on serving requests with a key: the first request with a key
claims it here, and within this gateway the key means what it means at the control plane (another request
with it is refused with ABORTED while it runs; after it completed, the same request gets the stored answer;
other parameters or another API key are refused). An execution that claimed its key at the control plane
before the outage and completes during it keeps its answer here, and a request with its key meets ABORTED
until the answer reaches the control plane. A key freed during the outage is freed there too.

Once a call to the control plane goes through again, the frees go first (so a key freed here and claimed
again here is free there), then each key claimed here is claimed there for the same execution and its
answer, if it has one, stored. New claims go to the control plane again only after that first call went
through; until every key is handed over, a key still held here is answered from here.

What it cannot promise: a request with the key that reaches another gateway during the outage, or a key that
another gateway claimed before it, runs there too, and each run is billed for what it delivered. The
handover then finds the key taken, leaves the control plane's record as it is, and counts a conflict.
"""

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from gateway.accounts.usage import HeldKey, UsageJournal
from gateway.metrics import IDEMPOTENCY_HANDOVER_CONFLICTS, IDEMPOTENCY_KEYS_HELD_ALONE, IDEMPOTENCY_OUTAGE_CLAIMS

log = logging.getLogger(__name__)

HANDOVER_RETRY_S = 1.0


@dataclasses.dataclass
class OutageClaim:
    held: HeldKey
    body: dict[str, Any] | None  # the claim as the control plane takes it; None: claimed there before the outage
    answer: dict[str, Any] | None = None  # the stored response, once the execution completed


class OutageClaims:
    def __init__(self, control_plane: ControlPlaneClient, journal: UsageJournal) -> None:
        self._control_plane = control_plane
        self._journal = journal
        self._by_key: dict[tuple[str, str], OutageClaim] = {}
        self._by_execution: dict[str, OutageClaim] = {}
        self._frees: dict[str, HeldKey] = {}  # by execution id: keys the control plane holds, freed here
        self._handover: asyncio.Task[None] | None = None
        self.outage = False  # set by the first call that fails; cleared by the first that goes through

    def find(self, organization_id: str, key: str) -> OutageClaim | None:
        return self._by_key.get((organization_id, key))

    def holds(self, execution_id: str) -> bool:
        return execution_id in self._by_execution

    @staticmethod
    def outcome(claim: OutageClaim, body: dict[str, Any]) -> dict[str, Any]:
        """What the control plane would answer `body`, a claim of a key held here, in its words."""
        if claim.body is None:  # the key's answer waits here for the control plane, which has its claim
            return {"outcome": "in_flight", "execution_id": claim.held.execution_id}
        if claim.body["caller"] != body["caller"]:
            return {"outcome": "other_caller", "execution_id": ""}
        if claim.body["fingerprint"] != body["fingerprint"]:
            return {"outcome": "mismatch", "execution_id": claim.held.execution_id}
        if claim.answer is not None:
            return {"outcome": "completed", "execution_id": claim.held.execution_id, "response": claim.answer}
        if claim.held.execution_id == body["execution_id"]:
            return {"outcome": "claimed", "execution_id": claim.held.execution_id}
        return {"outcome": "in_flight", "execution_id": claim.held.execution_id}

    def claim(self, held: HeldKey, body: dict[str, Any]) -> None:
        IDEMPOTENCY_OUTAGE_CLAIMS.inc()
        self._add(OutageClaim(held, body))

    def store(self, held: HeldKey, response: dict[str, Any]) -> None:
        """The answer of an execution under its key, held here until the control plane takes it."""
        claim = self._by_execution.get(held.execution_id) or self._add(OutageClaim(held, None))
        claim.answer = response
        self._hand_over_soon()

    def free(self, held: HeldKey) -> None:
        """A failed or cancelled execution's key: one claimed here is free at once; one the control plane
        holds is freed there first thing after the outage."""
        claim = self._by_execution.get(held.execution_id)
        if claim is not None and claim.body is not None:
            self._drop(claim)
            self._journal.drop_idempotency_key(held.execution_id)
            return
        if claim is not None:
            self._drop(claim)
        self._frees[held.execution_id] = held
        self.outage = True
        self._count()
        self._hand_over_soon()

    def _add(self, claim: OutageClaim) -> OutageClaim:
        self._by_key[(claim.held.organization_id, claim.held.key)] = claim
        self._by_execution[claim.held.execution_id] = claim
        self.outage = True
        self._count()
        self._hand_over_soon()
        return claim

    def _drop(self, claim: OutageClaim) -> None:
        self._by_key.pop((claim.held.organization_id, claim.held.key), None)
        self._by_execution.pop(claim.held.execution_id, None)
        self._count()

    def _count(self) -> None:
        IDEMPOTENCY_KEYS_HELD_ALONE.set(len(self._by_execution) + len(self._frees))

    # ---- the handover ----------------------------------------------------------------------------------

    def _hand_over_soon(self) -> None:
        if self._handover is None or self._handover.done():
            self._handover = asyncio.get_running_loop().create_task(self._hand_over_all())

    async def _hand_over_all(self) -> None:
        while self._frees or self._by_execution:
            try:
                await self._hand_over_frees()
                for claim in list(self._by_execution.values()):
                    await self._hand_over(claim)
            except (ControlPlaneUnavailable, TimeoutError) as error:
                log.info("the control plane is still unreachable (%r); handing keys over again soon", error)
                await asyncio.sleep(HANDOVER_RETRY_S)
            except Exception:
                log.exception("handing idempotency keys over to the control plane failed; trying again soon")
                await asyncio.sleep(HANDOVER_RETRY_S)

    async def _hand_over_frees(self) -> None:
        for held in list(self._frees.values()):
            await self._call(self._control_plane.release_idempotency_key, held.as_body())
            self._frees.pop(held.execution_id, None)
            self._journal.drop_idempotency_key(held.execution_id)
            self._count()

    async def _hand_over(self, claim: OutageClaim) -> None:
        held = claim.held
        if claim.body is not None:
            taken = await self._call(self._control_plane.claim_idempotency_key, claim.body)
            if taken is None or taken["outcome"] != "claimed":
                self._conflict(claim, taken)
                return
            if self._by_execution.get(held.execution_id) is not claim:  # freed while the claim went out
                self._frees[held.execution_id] = held
                return
            if claim.answer is None:  # still running: its key is the control plane's to hold from now on
                self._drop(claim)
                return
        body = {**held.as_body(), "response": claim.answer}
        await self._call(self._control_plane.complete_idempotency_key, body)
        self._drop(claim)
        self._journal.drop_idempotency_key(held.execution_id)

    async def _call(
        self, endpoint: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], body: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The call's answer; None when the control plane refused it (4xx), which no retry changes."""
        try:
            answer = await endpoint(body)
        except httpx.HTTPStatusError as error:
            log.warning("the control plane refused the handover of an idempotency key: %r", error)
            answer = None
        self.outage = False
        return answer

    def _conflict(self, claim: OutageClaim, taken: dict[str, Any] | None) -> None:
        IDEMPOTENCY_HANDOVER_CONFLICTS.inc()
        log.warning(
            "idempotency key of execution %s, claimed while the control plane was unreachable, had gone to %s: "
            "the key's request ran twice, each run billed for what it delivered",
            claim.held.execution_id,
            (taken or {}).get("execution_id") or "another caller",
        )
        self._drop(claim)
        self._journal.drop_idempotency_key(claim.held.execution_id)

    async def wait_idle(self, timeout_s: float) -> None:
        """Lets the handover finish, for at most `timeout_s`: what it did not hand over is lost with the
        process (the journal frees those keys when the gateway starts again)."""
        if self._handover is not None and not self._handover.done():
            done, _ = await asyncio.wait({self._handover}, timeout=timeout_s)
            if not done:
                self._handover.cancel()
