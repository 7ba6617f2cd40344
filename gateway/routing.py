"""Picks the workers for a request: a prefill and a decode worker in split mode, or one colocated worker."""

import enum
from collections import Counter
from dataclasses import dataclass

import grpc

from gateway.errors import GatewayError
from gateway.registry import Registry, WorkerInfo


class ServingMode(enum.StrEnum):
    AUTO = "auto"            # split when both fleets have ready workers, colocated otherwise
    SPLIT = "split"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class Route:
    prefill: WorkerInfo
    decode: WorkerInfo | None  # None: the prefill worker is colocated and does both phases

    @property
    def colocated(self) -> bool:
        return self.decode is None


class Router:
    def __init__(self, registry: Registry, mode: ServingMode) -> None:
        self._registry = registry
        self._mode = mode
        self._in_flight: Counter[str] = Counter()

    def route(self, model: str) -> Route:
        prefill = self._registry.ready_workers(model, "prefill")
        decode = self._registry.ready_workers(model, "decode")
        colocated = self._registry.ready_workers(model, "colocated")
        split_ready = bool(prefill and decode)
        if self._mode is ServingMode.SPLIT or (self._mode is ServingMode.AUTO and split_ready):
            if not split_ready:
                raise _no_workers(model, "prefill and decode")
            return Route(prefill=self._least_loaded(prefill), decode=self._least_loaded(decode))
        if not colocated:
            raise _no_workers(model, "colocated" if self._mode is ServingMode.COLOCATED else "prefill and decode, or colocated")
        return Route(prefill=self._least_loaded(colocated), decode=None)

    def acquire(self, route: Route) -> None:
        for worker in (route.prefill, route.decode):
            if worker is not None:
                self._in_flight[worker.id] += 1

    def release(self, route: Route) -> None:
        for worker in (route.prefill, route.decode):
            if worker is not None:
                self._in_flight[worker.id] -= 1

    def _least_loaded(self, workers: list[WorkerInfo]) -> WorkerInfo:
        return min(workers, key=lambda w: (self._in_flight[w.id], w.queue_depth + w.active_sequences))


def _no_workers(model: str, roles: str) -> GatewayError:
    return GatewayError(
        grpc.StatusCode.UNAVAILABLE, f"no ready {roles} workers serve {model} right now; retry shortly"
    )
