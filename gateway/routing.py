"""Picks the workers for a request from the workers' live load reports.

- Prefill worker: the least estimated work, where work is the prompt tokens it does not already hold in
  its prefix cache (matched against the block hashes it publishes, computed under the request's
  organization salt as the workers compute them) plus a fixed price per request waiting on it. Each
  worker is scored on its own, so one hot worker loses only its own requests.
- Decode worker: room for the sequence in its free KV blocks, then the least load net of the prompt's
  prefix it already holds (its published block hashes, as for prefill): the prefill worker sends it only
  the blocks after that prefix, so a conversation's next turn goes back to the worker that served the
  last one unless that worker has more sequences than the prefix is worth (each QUEUED_REQUEST_TOKENS
  held tokens outweigh one sequence), then the fewest active and waiting sequences.
- Split skip: a prompt that is short, or held by the decode worker's own prefix cache, is run whole on
  the decode worker (Generate) when its uncached part is at most `skip_split_below` tokens: the KV
  hand-off would cost more than the prefill it saves.
- Prefill overflow: when even the least loaded prefill worker has `prefill_overflow_tokens` of prompts
  still to compute, and the decode worker has fewer (this prompt included), the request runs whole on
  the decode worker rather than wait in the prefill queue.
- Pins and sessions: the extra choices of an n>1 request are pinned to the workers that ran its first
  choice (they hold its prompt's blocks) while those are usable; requests sharing a prompt_cache_key go
  to the prefill (or colocated) worker that served the key last, unless that worker is gone or its
  estimated work exceeds the least loaded one's by more than SESSION_SLACK_REQUESTS waiting requests.
  Each gateway remembers at most MAX_SESSIONS keys, least recently used first out.
- Regions: a request runs whole in one region when any region can take it, since a KV cache moving
  between regions is slow and costly. The order: the gateway's own region (`--region`), then the other
  regions, least loaded per usable worker first (then the most such workers, then the name, so the
  choice is deterministic); within a region the mode's order (auto: split when both phases are usable
  there, else colocated). In auto mode a colocated worker of the own region thus wins over a split pair
  elsewhere: it moves no KV cache and keeps the stream in the region the gateway serves. Only when no
  region can take the request whole: a pair across regions (each phase from the own region first), then
  workers that failed this request, then workers that have not reported load yet. A region whose
  workers are all draining, silent, broken or failed for this request counts as gone. Every route is
  counted in diptych_gateway_routed_requests_total{region, local}.
- Workers that failed this request are avoided; workers that stopped reporting load are not used.
"""

import enum
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass

from diptych_common.prefix_hash import block_hashes
from gateway.live_load import LiveLoad, LoadBoard
from gateway.metrics import ROUTED_REQUESTS
from gateway.registry import Registry, WorkerInfo
from gateway.types import ErrorKind, GatewayError

QUEUED_REQUEST_TOKENS = 128  # the work one waiting request stands for, in prompt tokens
SESSION_SLACK_REQUESTS = 4  # a prompt_cache_key's worker is overloaded beyond this many more waiting requests
MAX_SESSIONS = 65_536


class ServingMode(enum.StrEnum):
    AUTO = "auto"  # split when both fleets have ready workers, colocated otherwise
    SPLIT = "split"
    COLOCATED = "colocated"


class Decision(enum.StrEnum):
    SPLIT = "split"
    SPLIT_SKIPPED = "split_skipped"  # both phases on the decode worker
    COLOCATED = "colocated"


@dataclass(frozen=True)
class Route:
    prefill: WorkerInfo  # the worker that runs the prompt (both phases unless `decode` is set)
    decode: WorkerInfo | None
    decision: Decision
    matched_tokens: int = 0  # prompt tokens the prefill worker holds, by its published block hashes
    prompt_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        """The prompt tokens the prefill worker will compute."""
        return max(0, self.prompt_tokens - self.matched_tokens)

    @property
    def colocated(self) -> bool:
        return self.decode is None


@dataclass(frozen=True)
class Pin:
    """The workers a request should reuse while they are usable: those of its n>1 request's first choice."""

    prefill: str  # worker ids
    decode: str


@dataclass(frozen=True)
class RegionWorkers:
    """A region's workers that report fresh load, do not drain and have not failed this request, by role."""

    region: str
    prefill: list[WorkerInfo]
    decode: list[WorkerInfo]
    colocated: list[WorkerInfo]


@dataclass(frozen=True)
class RouteRequest:
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    avoid: frozenset[str] = frozenset()  # worker ids that already failed this request
    cache_salt: str = ""  # the organization's prefix-cache salt (PrefillRequest.cache_salt)
    pin: Pin | None = None
    session_key: str = ""  # the prompt_cache_key, scoped to the organization (empty: none)


class Lease:
    """A request counted on its workers, and its prompt counted on the worker that computes it."""

    def __init__(self, in_flight: Counter, prompting: Counter, held: list[str], prompt: tuple[str, int]) -> None:
        self._in_flight = in_flight
        self._prompting = prompting
        self._held = held
        self._prompt: tuple[str, int] | None = prompt
        prompting[prompt[0]] += prompt[1]

    def prompt_done(self) -> None:
        """The first token came: the prompt no longer waits on its worker."""
        if self._prompt is not None:
            worker_id, tokens = self._prompt
            self._prompting[worker_id] -= tokens
            self._prompt = None

    def release(self, worker_id: str | None = None) -> None:
        """Releases one worker (a prefill worker once its first token came), or all that are still held."""
        if worker_id is None or (self._prompt is not None and self._prompt[0] == worker_id):
            self.prompt_done()
        targets = list(self._held) if worker_id is None else [w for w in self._held if w == worker_id]
        for target in targets:
            self._held.remove(target)
            self._in_flight[target] -= 1


class Router:
    def __init__(
        self,
        registry: Registry,
        board: LoadBoard,
        mode: ServingMode,
        region: str = "",
        skip_split_below: int = 0,
        prefill_overflow_tokens: int = 0,
    ) -> None:
        self._registry = registry
        self._board = board
        self._mode = mode
        self._region = region
        self._skip_split_below = skip_split_below
        self._prefill_overflow_tokens = prefill_overflow_tokens
        self._in_flight: Counter[str] = Counter()
        self._prompting: Counter[str] = Counter()  # prompt tokens sent per worker, not yet at their first token
        self._no_generate: set[str] = set()  # decode workers that refused Generate
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session key -> worker id, least recent first

    def route(self, request: RouteRequest) -> Route:
        route = self._route(request)
        if request.session_key:
            self._remember_session(request.session_key, route.prefill.id)
        ROUTED_REQUESTS.labels(*self._region_labels(route)).inc()
        return route

    def _route(self, request: RouteRequest) -> Route:
        """Whole in one region when any can take the request (the own region first), else across regions."""
        region = self._best_region(request)
        if region is not None:
            return self._route_within(request, region)
        return self._route_across(request)

    def _best_region(self, request: RouteRequest) -> RegionWorkers | None:
        """Of the regions that can take the request whole: the gateway's own, else the one with the fewest
        pending requests per serving worker, then the most serving workers, then the first by name."""
        regions = [r for r in self._usable_by_region(request.model, request.avoid) if self._servers(r)]

        def rank(region: RegionWorkers) -> tuple[bool, float, int, str]:
            servers = self._servers(region)
            pending = sum(self._pending(w) for w in servers) / len(servers)
            return region.region != self._region, pending, -len(servers), region.region

        return min(regions, key=rank, default=None)

    def _servers(self, region: RegionWorkers) -> list[WorkerInfo]:
        """The region's workers the mode would run the request on: a split pair's fleets, or colocated
        workers (auto mode when no pair is usable there); none when the region cannot take it."""
        if self._mode is not ServingMode.COLOCATED and region.prefill and region.decode:
            return region.prefill + region.decode
        if self._mode is not ServingMode.SPLIT:
            return region.colocated
        return []

    def _route_within(self, request: RouteRequest, region: RegionWorkers) -> Route:
        if self._mode is not ServingMode.COLOCATED and region.prefill and region.decode:
            return self._split_route(request, region.prefill, region.decode)
        return self._colocated_route(request, region.colocated)

    def _usable_by_region(self, model: str, avoid: frozenset[str]) -> list[RegionWorkers]:
        def usable(role: str) -> list[WorkerInfo]:
            ready = self._registry.ready_workers(model, role)
            return [w for w in ready if w.id not in avoid and _usable(self._board.get(w.id))]

        prefill, decode, colocated = usable("prefill"), usable("decode"), usable("colocated")
        names = sorted({w.region for w in prefill + decode + colocated})
        return [
            RegionWorkers(
                name,
                prefill=[w for w in prefill if w.region == name],
                decode=[w for w in decode if w.region == name],
                colocated=[w for w in colocated if w.region == name],
            )
            for name in names
        ]

    def _region_labels(self, route: Route) -> tuple[str, str]:
        regions = [route.prefill.region] + ([route.decode.region] if route.decode else [])
        label = regions[0] if len(set(regions)) == 1 else ">".join(regions)
        local = not self._region or all(region == self._region for region in regions)
        return label, str(local).lower()

    def _route_across(self, request: RouteRequest) -> Route:
        """No region can take the request whole: each phase from its own best tier (`_candidates`)."""
        model = request.model
        if self._mode is not ServingMode.COLOCATED:
            prefill = self._candidates(model, "prefill", request.avoid)
            decode = self._candidates(model, "decode", request.avoid)
            if prefill and decode:
                return self._split_route(request, prefill, decode)
            if self._mode is ServingMode.SPLIT:
                raise _no_workers(model, "prefill and decode")
        colocated = self._candidates(model, "colocated", request.avoid)
        if not colocated:
            roles = "colocated" if self._mode is ServingMode.COLOCATED else "prefill and decode, or colocated"
            raise _no_workers(model, roles)
        return self._colocated_route(request, colocated)

    def _colocated_route(self, request: RouteRequest, colocated: list[WorkerInfo]) -> Route:
        least_loaded = min(colocated, key=lambda w: (self._pending(w), w.id))
        worker = self._preferred(request, colocated, least_loaded, lambda w: QUEUED_REQUEST_TOKENS * self._pending(w))
        return Route(
            prefill=worker, decode=None, decision=Decision.COLOCATED, prompt_tokens=len(request.prompt_token_ids)
        )

    def acquire(self, route: Route) -> "Lease":
        """Counts the request on its workers until the lease is released."""
        held = [route.prefill.id] + ([route.decode.id] if route.decode else [])
        for worker_id in held:
            self._in_flight[worker_id] += 1
        return Lease(self._in_flight, self._prompting, held, (route.prefill.id, route.uncached_tokens))

    def note_no_generate(self, worker_id: str) -> None:
        """The decode worker does not serve Generate: never skip the split onto it again."""
        self._no_generate.add(worker_id)

    def _split_route(self, request: RouteRequest, prefill: list[WorkerInfo], decode: list[WorkerInfo]) -> Route:
        prompt = request.prompt_token_ids
        chains: dict[int, list[int]] = {}  # the prompt's block hashes, per block size
        decode_worker = _pinned(request, decode, "decode") or self._pick_decode(request, decode, chains)
        may_skip = decode_worker.id not in self._no_generate
        held = self._matched_tokens(decode_worker, request, chains) if may_skip else 0
        whole_on_decode = Route(
            decode_worker, None, Decision.SPLIT_SKIPPED, matched_tokens=held, prompt_tokens=len(prompt)
        )
        if may_skip and self._skip_split_below and len(prompt) - held <= self._skip_split_below:
            return whole_on_decode
        matched = {w.id: self._matched_tokens(w, request, chains) for w in prefill}

        def work(worker: WorkerInfo) -> tuple[int, int, str]:
            pending = self._pending(worker)
            return len(prompt) - matched[worker.id] + QUEUED_REQUEST_TOKENS * pending, pending, worker.id

        worker = self._preferred(request, prefill, min(prefill, key=work), lambda w: work(w)[0])
        if may_skip and self._overflows(worker, decode_worker, len(prompt) - held):
            return whole_on_decode
        return Route(
            worker, decode_worker, Decision.SPLIT, matched_tokens=matched[worker.id], prompt_tokens=len(prompt)
        )

    def _preferred(self, request: RouteRequest, candidates: list[WorkerInfo], best: WorkerInfo, work) -> WorkerInfo:
        """The pinned worker if usable, else the session's worker unless overloaded, else `best`."""
        pinned = _pinned(request, candidates, "prefill")
        if pinned is not None:
            return pinned
        session_worker = self._sessions.get(request.session_key) if request.session_key else None
        slack = SESSION_SLACK_REQUESTS * QUEUED_REQUEST_TOKENS
        for worker in candidates:
            if worker.id == session_worker and work(worker) <= work(best) + slack:
                return worker
        return best

    def _remember_session(self, key: str, worker_id: str) -> None:
        self._sessions[key] = worker_id
        self._sessions.move_to_end(key)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def _overflows(self, prefill_worker: WorkerInfo, decode_worker: WorkerInfo, uncached_on_decode: int) -> bool:
        """The prefill fleet is backed up: even its least loaded worker has `prefill_overflow_tokens` of
        prompts ahead of this one, more than the decode worker would have with this prompt added. The
        request then runs whole on the decode worker, so both fleets' cores work on the queue."""
        if not self._prefill_overflow_tokens:
            return False
        ahead = self._prompt_backlog(prefill_worker)
        on_decode = self._prompt_backlog(decode_worker) + uncached_on_decode
        return ahead >= self._prefill_overflow_tokens and on_decode < ahead

    def _prompt_backlog(self, worker: WorkerInfo) -> int:
        """Prompt tokens the worker has still to compute: its report, or this gateway's count when that is
        higher (the report lags by up to 50 ms)."""
        load = self._board.fresh_load(worker.id)
        reported = load.prompt_tokens_pending if load is not None else 0
        return max(reported, self._prompting[worker.id])

    def _pick_decode(
        self, request: RouteRequest, workers: list[WorkerInfo], chains: dict[int, list[int]]
    ) -> WorkerInfo:
        tokens = len(request.prompt_token_ids) + request.max_tokens

        def room(worker: WorkerInfo) -> bool:
            load = self._board.fresh_load(worker.id)
            if load is None or not load.kv_blocks_total or not load.block_size:
                return True  # no block accounting published: assume room
            return load.kv_blocks_free >= math.ceil(tokens / load.block_size)

        def free_blocks(worker: WorkerInfo) -> int:
            load = self._board.fresh_load(worker.id)
            return load.kv_blocks_free if load is not None else 0

        with_room = [w for w in workers if room(w)] or workers
        held = {w.id: self._matched_tokens(w, request, chains) for w in with_room}

        def load(worker: WorkerInfo) -> tuple[int, int, str]:
            return QUEUED_REQUEST_TOKENS * self._pending(worker) - held[worker.id], -free_blocks(worker), worker.id

        return min(with_room, key=load)

    def _pending(self, worker: WorkerInfo) -> int:
        """Requests on the worker: its own report, or this gateway's count when that is higher (the
        report lags by up to 50 ms)."""
        load = self._board.fresh_load(worker.id)
        reported = 0
        if load is not None:
            reported = load.queue_depth + (load.active_sequences if worker.role != "prefill" else 0)
        return max(reported, self._in_flight[worker.id])

    def _matched_tokens(self, worker: WorkerInfo, request: RouteRequest, chains: dict[int, list[int]]) -> int:
        """Prompt tokens the worker holds for the request's organization: its published blocks that match
        the prompt's leading blocks, named under the request's cache salt as the worker names them."""
        live = self._board.get(worker.id)
        if live is None or live.load is None or not live.cached_blocks or not live.load.block_size:
            return 0
        block_size = live.load.block_size
        if block_size not in chains:
            chains[block_size] = block_hashes(request.prompt_token_ids, block_size, request.cache_salt)
        matched = 0
        for block in chains[block_size]:
            if block not in live.cached_blocks:
                break
            matched += block_size
        return matched

    def _candidates(self, model: str, role: str, avoid: frozenset[str]) -> list[WorkerInfo]:
        """Usable workers of the role, best tier first: those that have not failed this request, then
        those that did but still report load, then those with no load report yet; in each, the same
        region's first. Used when no region can take the request whole."""
        ready = self._registry.ready_workers(model, role)
        live = {w.id: self._board.get(w.id) for w in ready}
        usable = [w for w in ready if _usable(live[w.id])]
        fresh = [w for w in usable if w.id not in avoid]
        unreported = [w for w in ready if w.id not in avoid and _unreported(live[w.id])]
        tiers: list[list[WorkerInfo]] = []
        for tier in (fresh, usable, unreported):
            tiers += [[w for w in tier if w.region == self._region or not self._region], tier]
        return next((tier for tier in tiers if tier), [])


def _pinned(request: RouteRequest, candidates: list[WorkerInfo], phase: str) -> WorkerInfo | None:
    """The request's pinned worker for `phase` when it is among the usable candidates."""
    if request.pin is None:
        return None
    wanted = request.pin.prefill if phase == "prefill" else request.pin.decode
    return next((w for w in candidates if w.id == wanted and w.id not in request.avoid), None)


def _usable(live: LiveLoad | None) -> bool:
    load = live.fresh_load if live is not None else None
    return load is not None and not load.draining


def _unreported(live: LiveLoad | None) -> bool:
    return live is None or (live.load is None and not live.broken)


def _no_workers(model: str, roles: str) -> GatewayError:
    return GatewayError(ErrorKind.UNAVAILABLE, f"no ready {roles} workers serve {model} right now; retry shortly")
