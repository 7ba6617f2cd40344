"""Two candidates drawn at random, the one with less estimated work taken (decode: among those with room
for the sequence). Near the least-loaded spread without ranking every worker, and no herd on the one
worker that looked idlest when many gateways route on load reports of the same age. It does not weigh
prefix caches."""

import random

from gateway.fleet.registry import WorkerInfo
from gateway.routing.fleet_view import FleetView
from gateway.routing.route import Phase


class PowerOfTwo:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, phase: Phase, candidates: list[WorkerInfo], fleet: FleetView) -> WorkerInfo:
        if phase is Phase.DECODE:
            candidates = [w for w in candidates if fleet.has_room(w)] or candidates
        drawn = candidates if len(candidates) <= 2 else self._rng.sample(candidates, 2)
        return min(drawn, key=lambda w: (fleet.work(w, phase), w.id))
