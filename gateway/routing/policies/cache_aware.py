"""The default policy: the least estimated work, counting the prompt tokens each worker already holds.

- Prefill: the prompt tokens the worker does not hold in its prefix cache plus a fixed price per request
  waiting on it; each worker is scored on its own, so one hot worker loses only its own requests.
- Decode: room for the sequence in its free KV blocks, then the least load net of the prompt's prefix it
  holds (the prefill worker sends it only the blocks after that prefix), so a conversation's next turn
  goes back to the worker that served the last one unless that worker has more sequences than the prefix
  is worth; then the most free blocks.
- Colocated: the fewest requests on the worker.
Ties go to the lowest worker id, so a choice is deterministic.
"""

from gateway.fleet.registry import WorkerInfo
from gateway.routing.fleet_view import QUEUED_REQUEST_TOKENS, FleetView
from gateway.routing.route import Phase


class CacheAware:
    def pick(self, phase: Phase, candidates: list[WorkerInfo], fleet: FleetView) -> WorkerInfo:
        if phase is Phase.DECODE:
            return _decode_worker(candidates, fleet)
        return min(candidates, key=lambda w: (fleet.work(w, phase), fleet.pending(w), w.id))


def _decode_worker(candidates: list[WorkerInfo], fleet: FleetView) -> WorkerInfo:
    with_room = [w for w in candidates if fleet.has_room(w)] or candidates

    def load(worker: WorkerInfo) -> tuple[int, int, str]:
        held = fleet.matched_tokens(worker)
        return QUEUED_REQUEST_TOKENS * fleet.pending(worker) - held, -fleet.free_blocks(worker), worker.id

    return min(with_room, key=load)
