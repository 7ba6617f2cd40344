"""Routing policies: the router asks its policy for every phase's worker and keeps the rest (pins,
sessions, split skip); the power-of-two policy takes the less loaded of the two it draws; the gateway's
command refuses a policy it does not know."""

import random
from collections import Counter

import pytest

from diptych_server.cli import main
from gateway.fleet.registry import WorkerInfo
from gateway.routing.fleet_view import FleetView
from gateway.routing.policies.power_of_two import PowerOfTwo
from gateway.routing.route import Decision, Phase, Pin, RouteRequest, ServingMode
from gateway.routing.router import Router
from tests.gateway.test_routing import Fleet, request, two_by_two, worker


class HighestId:
    """A policy of the test's own: the last worker by id, whatever the load."""

    def pick(self, phase: Phase, candidates: list[WorkerInfo], fleet: FleetView) -> WorkerInfo:
        return max(candidates, key=lambda w: w.id)


def test_the_router_takes_every_phases_worker_from_its_policy():
    fleet = two_by_two()
    fleet.report("p2", queue_depth=9)
    fleet.report("d2", active_sequences=9)
    router = Router(fleet.registry, fleet.board, ServingMode.SPLIT, "local", policy=HighestId())
    route = router.route(request([5] * 40))
    assert (route.prefill.id, route.decode.id, route.decision) == ("p2", "d2", Decision.SPLIT)
    colocated = Fleet(worker("c1", "colocated"), worker("c2", "colocated"))
    colocated.report("c1")
    colocated.report("c2", active_sequences=9)
    router = Router(colocated.registry, colocated.board, ServingMode.COLOCATED, "local", policy=HighestId())
    assert router.route(request([5] * 40)).prefill.id == "c2"


def test_pins_and_the_split_skip_stay_with_the_router_whatever_the_policy():
    fleet = two_by_two()
    router = Router(fleet.registry, fleet.board, ServingMode.SPLIT, "local", skip_split_below=8, policy=HighestId())
    pinned = RouteRequest("m", [5] * 40, 16, pin=Pin(prefill="p1", decode="d1"))
    route = router.route(pinned)
    assert (route.prefill.id, route.decode.id) == ("p1", "d1")
    short = router.route(request([5] * 4))
    assert (short.prefill.id, short.decision) == ("d2", Decision.SPLIT_SKIPPED)


def test_power_of_two_takes_the_less_loaded_of_the_two_it_draws():
    workers = [worker(f"p{i}", "prefill") for i in range(4)]
    fleet = Fleet(*workers)
    for depth, w in enumerate(workers):
        fleet.report(w.id, queue_depth=depth)
    view = FleetView(fleet.board, Counter(), Counter(), request([5] * 40))
    policy = PowerOfTwo(random.Random(7))
    picks = Counter(policy.pick(Phase.PREFILL, workers, view).id for _ in range(600))
    assert "p3" not in picks  # the most loaded loses every draw it is in
    # p0 wins every draw that holds it (half of the six pairs); p2 only the pair it makes with p3.
    assert picks["p0"] > picks["p1"] > picks["p2"] > 0
    assert 250 < picks["p0"] < 350


def test_power_of_two_prefers_decode_workers_with_room_for_the_sequence():
    fleet = Fleet(worker("d1", "decode"), worker("d2", "decode"))
    fleet.report("d1", kv_blocks_total=64, kv_blocks_free=1)
    fleet.report("d2", kv_blocks_total=64, kv_blocks_free=64, active_sequences=5)
    view = FleetView(fleet.board, Counter(), Counter(), request([5] * 40))
    assert PowerOfTwo().pick(Phase.DECODE, list(fleet.by_id.values()), view).id == "d2"


def test_the_gateway_command_refuses_an_unknown_routing_policy():
    with pytest.raises(SystemExit, match="--routing-policy is one of cache_aware, power_of_two"):
        main(["gateway", "--routing-policy", "round_robin"])
