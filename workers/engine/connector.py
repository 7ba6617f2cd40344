"""The KV connector: the one interface between the engine and KV that comes from or goes to outside the
worker.

A connector has two sides. Its scheduler side runs on the event loop: before the engine takes a request
(`prepare`: a fetch it awaits), as the scheduler admits one (the tokens or blocks it loads rather than the
engine computing them: `num_external_tokens` before any local prefix hit, `blocks_after_hit` after one),
as it decides a step (`build_meta`, a `KvConnectorMeta` of plain data) and around the engine's bookkeeping
after a step (`before_update`, `after_update`: the step's full blocks get their prefix-cache names in
between). Its worker side carries the step's part out on the forward thread, around the forward pass:
`wait_for_save` before the step (blocks freed since the last step are no longer read by a save, so the
step may overwrite them), `load_kv` before the forward pass, `save_kv` after it. The engine calls nothing
else of it; the server hands it a request's part in a hand-off as `KvTransferParams` on the request.

Every hook but four does nothing unless a connector defines it. Those four every connector defines:
`build_meta` (what it does in a step), `request_finished` (what it holds for a request goes with it),
`stats` (the bytes it moved, which the worker's load reports carry) and `close` (the port or client it
moves KV through).

Implementations: `NullConnector` (a worker that moves no KV: the engine's until one is attached), and in
`workers.kv_connector`: `prefill.PrefillConnector` (a prefill worker streams each request's KV to its
decode worker as it is computed), `decode.DecodeConnector` (a decode worker loads the KV it received),
both over a data path (TCP, shared memory or NIXL: `paths`); `tier.TierConnector` (prefix blocks fetched
from and written through to the shared KV tier); `multi.MultiConnector` composes them (a prefill worker's
hand-off with the tier).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from typing_extensions import override

from workers.engine.kv_transfer import EMPTY_META, KvConnectorMeta

if TYPE_CHECKING:
    from concurrent.futures import Future

    from workers.engine.kv_cache_manager import KVCacheManager
    from workers.engine.request import EngineRequest
    from workers.engine.schedule import SchedulerOutput
    from workers.runner.kv_pool import KvPool


@dataclass(frozen=True)
class KvSent:
    """A request's KV arrived whole and checked at its decode worker."""

    nbytes: int
    data_path: str


@dataclass(frozen=True)
class TierStats:
    hit_tokens: int = 0  # prompt tokens loaded from the tier instead of computed
    queried_tokens: int = 0  # prompt tokens it was asked for (those after the local prefix hits)
    blocks_put: int = 0  # blocks shipped to it (write-through of every full block computed)
    blocks_dropped: int = 0  # blocks not shipped: the put queue was full, or the tier unreachable
    errors: int = 0  # failed calls and damaged blocks (each one computed here instead)


@dataclass(frozen=True)
class KvConnectorStats:
    sent_by_path: dict[str, int] = field(default_factory=dict)  # KV bytes delivered, by data path
    received_by_path: dict[str, int] = field(default_factory=dict)
    tier: TierStats | None = None  # where a connector shares blocks through the KV tier


class KvConnector(ABC):
    """The hooks not marked abstract do nothing unless a connector defines them."""

    # The engine reads it once, when the connector is attached: False skips the per-step hooks
    # (step_done, before_update, after_update and the worker side), which then must do nothing.
    moves_kv = True

    # ---- scheduler side: the event loop's thread ------------------------------------------------

    async def prepare(self, request: EngineRequest) -> None:
        """Before the engine takes the request: a connector that fetches KV for it does so here."""
        return None

    def discard(self, request: EngineRequest) -> None:
        """The engine refused the request after `prepare`: what was fetched for it goes."""
        return None

    def add_request(self, request: EngineRequest) -> Future[KvSent] | None:
        """The engine took the request. A connector that sends its KV starts the transfer and returns
        its outcome (KvSent, or a KvTransferError)."""
        return None

    def num_external_tokens(self, request: EngineRequest) -> int:
        """At admission: how many of the request's first tokens this connector loads (0: none). The
        scheduler then computes only the tokens after them and lists the request in SchedulerOutput.loads."""
        return 0

    def blocks_after_hit(self, request: EngineRequest, hit_blocks: int) -> int:
        """At admission from the prefix cache, `hit_blocks` blocks of the prompt held here: how many blocks
        right after them this connector loads (0: none). The last prompt token is always computed."""
        return 0

    def load_after_hit(self, request: EngineRequest, hit_blocks: int, block_ids: list[int]) -> None:
        """The request was admitted after a hit of `hit_blocks` blocks: `block_ids` (as many as
        `blocks_after_hit` said, or none) are the blocks after them this step loads; anything else fetched
        for it goes."""
        return None

    @abstractmethod
    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        """What the step `out` loads and saves; called once per step that computes anything."""

    def request_preempted(self, request: EngineRequest) -> None:
        """The request's blocks were freed; it will be recomputed from its tokens."""
        return None

    @abstractmethod
    def request_finished(self, request: EngineRequest) -> None:
        """The request left (`request.finish_reason` says why) and its blocks were freed."""

    def step_done(self, meta: KvConnectorMeta) -> None:
        """The step of `meta` ended, or failed: the forward thread no longer reads what it named."""
        return None

    def before_update(self, out: SchedulerOutput) -> None:
        """The step `out` ran; the engine has not yet counted its tokens or named its full blocks."""
        return None

    async def after_update(self, out: SchedulerOutput) -> None:
        """The engine counted the step's tokens and named its full blocks (the prefix cache's hashes)."""
        return None

    @abstractmethod
    def stats(self) -> KvConnectorStats:
        """Bytes moved so far."""

    @abstractmethod
    async def close(self) -> None:
        """The worker stops."""

    # ---- worker side: the forward thread ----------------------------------------------------------

    def wait_for_save(self, meta: KvConnectorMeta) -> None:
        """Before the step: saves no longer read the blocks of meta.freed (the step may overwrite them)."""
        return None

    def load_kv(self, meta: KvConnectorMeta, runner: KvPool) -> None:
        """Before the forward pass: writes meta.loads into the pool."""
        return None

    def save_kv(self, meta: KvConnectorMeta, runner: KvPool) -> None:
        """After the forward pass: hands meta.saves to their transfers."""
        return None


class NullConnector(KvConnector):
    """The connector of a worker that moves no KV (a colocated worker without the KV tier)."""

    moves_kv = False

    @override
    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        return EMPTY_META

    def request_finished(self, request: EngineRequest) -> None:
        pass  # it holds nothing for a request

    def stats(self) -> KvConnectorStats:
        return KvConnectorStats()

    async def close(self) -> None:
        pass  # it holds no port or client
