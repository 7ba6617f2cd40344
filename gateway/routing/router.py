"""Picks the workers for a request from the workers' live load reports.

- Which worker of a phase: the routing policy's pick (gateway/routing/policies/, `--routing-policy`;
  by default the least estimated work, counting the prompt tokens each worker holds in its prefix cache).
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

from collections import Counter, OrderedDict
from dataclasses import dataclass

from diptych_common.prefix_hash import block_hashes
from gateway.fleet.live_load import LiveLoad, LoadBoard
from gateway.fleet.registry import Registry, WorkerInfo
from gateway.metrics import ROUTED_REQUESTS
from gateway.routing.fleet_view import QUEUED_REQUEST_TOKENS, FleetView
from gateway.routing.policies.base import RoutingPolicy
from gateway.routing.policies.cache_aware import CacheAware
from gateway.routing.route import Decision, Phase, Route, RouteRequest, ServingMode
from gateway.types import ErrorKind, GatewayError

SESSION_SLACK_REQUESTS = 4  # a prompt_cache_key's worker is overloaded beyond this many more waiting requests
MAX_SESSIONS = 65_536


@dataclass(frozen=True)
class RegionWorkers:
    """A region's workers that report fresh load, do not drain and have not failed this request, by role."""

    region: str
    prefill: list[WorkerInfo]
    decode: list[WorkerInfo]
    colocated: list[WorkerInfo]


class Lease:
    """A request counted on its workers, and its prompt counted on the worker that computes it."""

    def __init__(
        self, in_flight: Counter[str], prompting: Counter[str], held: list[str], prompt: tuple[str, int]
    ) -> None:
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
        policy: RoutingPolicy | None = None,
    ) -> None:
        self._registry = registry
        self._board = board
        self._mode = mode
        self._region = region
        self._skip_split_below = skip_split_below
        self._prefill_overflow_tokens = prefill_overflow_tokens
        self._policy = policy or CacheAware()
        self._in_flight: Counter[str] = Counter()
        self._prompting: Counter[str] = Counter()  # prompt tokens sent per worker, not yet at their first token
        self._no_generate: set[str] = set()  # decode workers that refused Generate
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session key -> worker id, least recent first

    def route(self, request: RouteRequest) -> Route:
        route = self._route(FleetView(self._board, self._in_flight, self._prompting, request))
        if request.session_key:
            self._remember_session(request.session_key, route.prefill.id)
        ROUTED_REQUESTS.labels(*self._region_labels(route)).inc()
        return route

    def _route(self, fleet: FleetView) -> Route:
        """Whole in one region when any can take the request (the own region first), else across regions."""
        region = self._best_region(fleet)
        if region is not None:
            return self._route_within(fleet, region)
        return self._route_across(fleet)

    def _best_region(self, fleet: FleetView) -> RegionWorkers | None:
        """Of the regions that can take the request whole: the gateway's own, else the one with the fewest
        pending requests per serving worker, then the most serving workers, then the first by name."""
        request = fleet.request
        regions = [r for r in self._usable_by_region(request.model, request.avoid) if self._servers(r)]

        def rank(region: RegionWorkers) -> tuple[bool, float, int, str]:
            servers = self._servers(region)
            pending = sum(fleet.pending(w) for w in servers) / len(servers)
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

    def _route_within(self, fleet: FleetView, region: RegionWorkers) -> Route:
        if self._mode is not ServingMode.COLOCATED and region.prefill and region.decode:
            return self._split_route(fleet, region.prefill, region.decode)
        return self._colocated_route(fleet, region.colocated)

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

    def _route_across(self, fleet: FleetView) -> Route:
        """No region can take the request whole: each phase from its own best tier (`_candidates`)."""
        model, avoid = fleet.request.model, fleet.request.avoid
        if self._mode is not ServingMode.COLOCATED:
            prefill = self._candidates(model, "prefill", avoid)
            decode = self._candidates(model, "decode", avoid)
            if prefill and decode:
                return self._split_route(fleet, prefill, decode)
            if self._mode is ServingMode.SPLIT:
                raise _no_workers(model, "prefill and decode")
        colocated = self._candidates(model, "colocated", avoid)
        if not colocated:
            roles = "colocated" if self._mode is ServingMode.COLOCATED else "prefill and decode, or colocated"
            raise _no_workers(model, roles)
        return self._colocated_route(fleet, colocated)

    def _colocated_route(self, fleet: FleetView, colocated: list[WorkerInfo]) -> Route:
        worker = self._preferred(fleet, Phase.COLOCATED, colocated)
        prompt_tokens = len(fleet.request.prompt_token_ids)
        return Route(prefill=worker, decode=None, decision=Decision.COLOCATED, prompt_tokens=prompt_tokens)

    def acquire(self, route: Route) -> "Lease":
        """Counts the request on its workers until the lease is released."""
        held = [route.prefill.id] + ([route.decode.id] if route.decode else [])
        for worker_id in held:
            self._in_flight[worker_id] += 1
        return Lease(self._in_flight, self._prompting, held, (route.prefill.id, route.uncached_tokens))

    def note_finished(self, route: Route, sequence: list[int], cache_salt: str) -> None:
        """The request ended with `sequence` (its prompt and every output token) on the route's last worker,
        which now holds the KV of all of it but the last token: a continuation routed before the worker's
        next report finds it there."""
        worker = route.decode or route.prefill
        live = self._board.get(worker.id)
        if live is None or live.load is None or not live.load.block_size:
            return
        self._board.note_finished(worker.id, block_hashes(sequence[:-1], live.load.block_size, cache_salt))

    def note_no_generate(self, worker_id: str) -> None:
        """The decode worker does not serve Generate: never skip the split onto it again."""
        self._no_generate.add(worker_id)

    def _split_route(self, fleet: FleetView, prefill: list[WorkerInfo], decode: list[WorkerInfo]) -> Route:
        request = fleet.request
        prompt_tokens = len(request.prompt_token_ids)
        decode_worker = _pinned(request, decode, Phase.DECODE) or self._policy.pick(Phase.DECODE, decode, fleet)
        may_skip = decode_worker.id not in self._no_generate
        held = fleet.matched_tokens(decode_worker) if may_skip else 0
        whole_on_decode = Route(
            decode_worker, None, Decision.SPLIT_SKIPPED, matched_tokens=held, prompt_tokens=prompt_tokens
        )
        if may_skip and self._skip_split_below and prompt_tokens - held <= self._skip_split_below:
            return whole_on_decode
        worker = self._preferred(fleet, Phase.PREFILL, prefill)
        if may_skip and self._overflows(fleet, worker, decode_worker, prompt_tokens - held):
            return whole_on_decode
        matched = fleet.matched_tokens(worker)
        return Route(worker, decode_worker, Decision.SPLIT, matched_tokens=matched, prompt_tokens=prompt_tokens)

    def _preferred(self, fleet: FleetView, phase: Phase, candidates: list[WorkerInfo]) -> WorkerInfo:
        """The pinned worker if usable, else the session's worker unless overloaded, else the policy's pick."""
        pinned = _pinned(fleet.request, candidates, Phase.PREFILL)
        if pinned is not None:
            return pinned
        best = self._policy.pick(phase, candidates, fleet)
        key = fleet.request.session_key
        session_worker = self._sessions.get(key) if key else None
        slack = SESSION_SLACK_REQUESTS * QUEUED_REQUEST_TOKENS
        for worker in candidates:
            if worker.id == session_worker and fleet.work(worker, phase) <= fleet.work(best, phase) + slack:
                return worker
        return best

    def _remember_session(self, key: str, worker_id: str) -> None:
        self._sessions[key] = worker_id
        self._sessions.move_to_end(key)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def _overflows(
        self, fleet: FleetView, prefill_worker: WorkerInfo, decode_worker: WorkerInfo, uncached_on_decode: int
    ) -> bool:
        """The prefill fleet is backed up: even its least loaded worker has `prefill_overflow_tokens` of
        prompts ahead of this one, more than the decode worker would have with this prompt added. The
        request then runs whole on the decode worker, so both fleets' cores work on the queue."""
        if not self._prefill_overflow_tokens:
            return False
        ahead = fleet.prompt_backlog(prefill_worker)
        on_decode = fleet.prompt_backlog(decode_worker) + uncached_on_decode
        return ahead >= self._prefill_overflow_tokens and on_decode < ahead

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


def _pinned(request: RouteRequest, candidates: list[WorkerInfo], phase: Phase) -> WorkerInfo | None:
    """The request's pinned worker for `phase` when it is among the usable candidates."""
    if request.pin is None:
        return None
    wanted = request.pin.prefill if phase is Phase.PREFILL else request.pin.decode
    return next((w for w in candidates if w.id == wanted and w.id not in request.avoid), None)


def _usable(live: LiveLoad | None) -> bool:
    load = live.fresh_load if live is not None else None
    return load is not None and not load.draining


def _unreported(live: LiveLoad | None) -> bool:
    return live is None or (live.load is None and not live.broken)


def _no_workers(model: str, roles: str) -> GatewayError:
    return GatewayError(ErrorKind.UNAVAILABLE, f"no ready {roles} workers serve {model} right now; retry shortly")
