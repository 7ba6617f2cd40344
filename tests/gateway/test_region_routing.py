"""Regions: a request runs whole in one region when any region can take it (the gateway's own first, then
the least loaded other), a pair across regions only when none can, pins and sessions within those rules,
and the routed-requests counter that makes a failover visible."""

import pytest

from diptych_common.proto.v1 import worker_pb2
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry, WorkerInfo
from gateway.metrics import ROUTED_REQUESTS
from gateway.routing.route import Decision, Pin, RouteRequest, ServingMode
from gateway.routing.router import Router
from gateway.types import GatewayError

PROMPT = [5] * 40


class Fleets:
    """Workers named `<role letter>-<region>[-n]` (p-east, d-west-2, c-east), each reporting an idle load
    unless told otherwise."""

    def __init__(self, *names: str, reported: bool = True) -> None:
        roles = {"p": "prefill", "d": "decode", "c": "colocated"}
        self.workers = {
            name: WorkerInfo(name, roles[name[0]], "m", name.split("-")[1], f"127.0.0.1:{40000 + i}", "ready", 0, 0)
            for i, name in enumerate(names)
        }
        self.registry = Registry(control_plane=None)
        self.registry.workers = list(self.workers.values())
        self.board = LoadBoard(Channels())
        if reported:
            for name in names:
                self.report(name)

    def report(self, name: str, **fields) -> None:
        self.board.report(self.workers[name], worker_pb2.Load(worker_id=name, block_size=16, **fields))

    def drain(self, *names: str) -> None:
        for name in names:
            self.report(name, draining=True)

    def router(self, mode: ServingMode = ServingMode.SPLIT, region: str = "east") -> Router:
        return Router(self.registry, self.board, mode, region)


def pair(route) -> tuple[str, str | None]:
    return route.prefill.id, route.decode.id if route.decode else None


def route(router: Router, avoid=(), **fields):
    return router.route(RouteRequest("m", PROMPT, 8, frozenset(avoid), **fields))


def test_the_own_region_wins_even_when_it_is_busier():
    fleets = Fleets("p-east", "d-east", "p-west", "d-west")
    fleets.report("p-east", queue_depth=20)
    fleets.report("d-east", active_sequences=30)
    assert pair(route(fleets.router())) == ("p-east", "d-east")
    assert pair(route(fleets.router(region="west"))) == ("p-west", "d-west")


@pytest.mark.parametrize("gone", ["drained", "broken", "silent"])
def test_a_region_whose_workers_are_all_drained_or_gone_sends_every_request_elsewhere(gone):
    fleets = Fleets("p-east", "d-east", "p-west", "d-west")
    for name in ("p-east", "d-east"):
        if gone == "drained":
            fleets.drain(name)
        elif gone == "broken":
            fleets.board.mark_broken(name)
        else:
            fleets.board.get(name).updated_at -= 10  # its last report is long stale
    router = fleets.router()
    assert {pair(route(router)) for _ in range(4)} == {("p-west", "d-west")}
    fleets.report("p-east")
    fleets.report("d-east")  # back: the own region wins again
    assert pair(route(router)) == ("p-east", "d-east")


def test_a_phase_missing_in_the_own_region_moves_the_whole_request_to_a_region_with_both():
    fleets = Fleets("p-east", "d-east", "d-north", "p-west", "d-west")
    fleets.drain("d-east")
    # north's decode worker is idle and west's busy, but only west runs both phases.
    fleets.report("d-west", active_sequences=6)
    assert pair(route(fleets.router())) == ("p-west", "d-west")
    fleets.drain("p-west")
    # Now no region has both phases: a pair across regions, each phase from the own region first.
    assert pair(route(fleets.router())) == ("p-east", "d-north")


def test_a_pair_across_regions_only_when_no_region_has_both_phases():
    fleets = Fleets("p-east", "d-west", "p-north", "d-north")
    assert pair(route(fleets.router())) == ("p-north", "d-north")
    fleets.drain("d-north")
    assert pair(route(fleets.router())) == ("p-east", "d-west")


def test_other_regions_by_load_per_worker_then_by_size_then_by_name():
    fleets = Fleets("p-east", "d-east", "p-west", "d-west", "p-north", "d-north", "p-south", "d-south", "d-south-2")
    fleets.drain("p-east", "d-east")
    fleets.report("p-west", queue_depth=3)
    router = fleets.router()
    # north and south are idle: south has more workers; west has requests waiting.
    assert pair(route(router)) == ("p-south", "d-south")
    fleets.drain("d-south-2")
    assert pair(route(router)) == ("p-north", "d-north")  # north and south alike: by name
    fleets.report("d-north", active_sequences=8)
    fleets.report("d-south", active_sequences=8)
    assert pair(route(router)) == ("p-west", "d-west")  # 3 waiting on 2 workers beats 8 on 2


def test_requests_this_gateway_sent_weigh_on_their_region():
    fleets = Fleets("p-west", "d-west", "p-north", "d-north")
    router = fleets.router()  # its own region, east, has no workers
    first = route(router)
    router.acquire(first)
    second = route(router)
    assert {pair(first), pair(second)} == {("p-north", "d-north"), ("p-west", "d-west")}


def test_auto_mode_prefers_an_own_region_colocated_worker_to_a_split_pair_elsewhere():
    fleets = Fleets("c-east", "p-west", "d-west", "c-north")
    router = fleets.router(mode=ServingMode.AUTO)
    chosen = route(router)
    assert chosen.decision is Decision.COLOCATED and chosen.prefill.id == "c-east"
    fleets.drain("c-east")
    assert pair(route(router)) == ("p-west", "d-west")  # both idle: west has more workers
    fleets.report("p-west", queue_depth=4)
    assert pair(route(router)) == ("c-north", None)  # the least loaded region, though only colocated


def test_auto_mode_splits_within_the_own_region_before_anything_else():
    fleets = Fleets("c-east", "p-east", "d-east", "p-west", "d-west")
    assert pair(route(fleets.router(mode=ServingMode.AUTO))) == ("p-east", "d-east")


def test_colocated_mode_stays_in_the_own_region_then_moves_whole():
    fleets = Fleets("c-east", "c-west", "p-east", "d-east")
    fleets.report("c-east", queue_depth=9)
    router = fleets.router(mode=ServingMode.COLOCATED)
    assert pair(route(router)) == ("c-east", None)
    fleets.drain("c-east")
    assert pair(route(router)) == ("c-west", None)


def test_pins_and_sessions_hold_within_the_chosen_region():
    fleets = Fleets("p-east", "p-east-2", "d-east", "d-east-2", "p-west", "d-west")
    fleets.report("p-east-2", queue_depth=2)
    fleets.report("d-east-2", active_sequences=2)
    router = fleets.router()
    assert pair(route(router, pin=Pin("p-east-2", "d-east-2"))) == ("p-east-2", "d-east-2")
    # A pin to the other region's workers gives way to the own region, which can take the request.
    assert pair(route(router, pin=Pin("p-west", "d-west"))) == ("p-east", "d-east")
    fleets.drain("p-east", "p-east-2")
    assert pair(route(router, pin=Pin("p-west", "d-west"))) == ("p-west", "d-west")

    fleets.report("p-east")
    fleets.report("p-east-2", queue_depth=2)
    assert route(router, session_key="k").prefill.id == "p-east"
    fleets.report("p-east", queue_depth=3)
    assert route(router, session_key="k").prefill.id == "p-east"  # the session's worker, though busier
    fleets.drain("p-east", "p-east-2")
    assert route(router, session_key="k").prefill.id == "p-west"  # its region is gone: the key moves
    fleets.report("p-east")
    assert route(router, session_key="k").prefill.id == "p-east"  # a session never outweighs the region


def test_a_worker_that_failed_the_request_makes_its_region_unable_to_take_it():
    fleets = Fleets("p-east", "d-east", "p-west", "d-west")
    fleets.report("p-east", queue_depth=2)
    fleets.report("d-east", active_sequences=2)
    router = fleets.router()
    # The decode worker failed mid-stream: the request moves whole to west, not to east's prefill + west's decode.
    assert pair(route(router, avoid={"d-east"})) == ("p-west", "d-west")
    # Every worker failed it: the failed workers are tried again rather than none, the own region's first.
    assert pair(route(router, avoid=set(fleets.workers))) == ("p-east", "d-east")


def test_workers_without_a_load_report_are_used_only_when_no_reported_one_is_left():
    fleets = Fleets("p-east", "d-east", "p-west", "d-west", reported=False)
    assert pair(route(fleets.router(region="west"))) == ("p-west", "d-west")  # none reported: the own region's
    fleets.report("p-west")
    fleets.report("d-west")
    assert pair(route(fleets.router())) == ("p-west", "d-west")
    fleets.board.mark_broken("p-west")
    fleets.board.mark_broken("d-west")
    assert pair(route(fleets.router())) == ("p-east", "d-east")  # never reported, never failed: better than none
    fleets.board.mark_broken("p-east")
    with pytest.raises(GatewayError):
        route(fleets.router())


def test_a_gateway_without_a_region_keeps_each_pair_in_one_region():
    fleets = Fleets("p-east", "d-east", "p-west", "d-west")
    fleets.report("p-east", queue_depth=4)  # the least loaded prefill worker is west's, the decode worker east's
    fleets.report("d-west", active_sequences=1)
    router = fleets.router(region="")
    assert pair(route(router)) == ("p-west", "d-west")
    assert router._region_labels(route(router)) == ("west", "true")


def routed(region: str, local: str) -> float:
    return ROUTED_REQUESTS.labels(region, local)._value.get()


def test_routes_are_counted_by_region_and_whether_they_stayed_local():
    fleets = Fleets("p-east", "d-east", "d-west")
    router = fleets.router()
    before = {labels: routed(*labels) for labels in (("east", "true"), ("east>west", "false"))}
    route(router)
    fleets.drain("d-east")
    route(router)
    route(router)
    assert routed("east", "true") == before[("east", "true")] + 1
    assert routed("east>west", "false") == before[("east>west", "false")] + 2
