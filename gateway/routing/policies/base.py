"""A routing policy picks one worker of a phase's candidates. The router decides everything around it
(regions, pins, sessions, split skip and overflow, leases); a policy only ranks the workers it is given."""

from typing import Protocol

from gateway.fleet.registry import WorkerInfo
from gateway.routing.fleet_view import FleetView
from gateway.routing.route import Phase


class RoutingPolicy(Protocol):
    def pick(self, phase: Phase, candidates: list[WorkerInfo], fleet: FleetView) -> WorkerInfo:
        """One of `candidates` (never empty) to run `fleet.request`'s phase."""
        ...
