"""The gateway's registry view through control-plane outages: workers it sees alive itself stay
routable while the control plane cannot be reached or has not heard from them yet; drains are honoured."""

import pytest

from gateway.control_plane import ControlPlaneUnavailable
from gateway.registry import Registry

MODEL = {"name": "m", "source": "builtin:m", "context_length": 64}


def listed(worker_id: str, state: str = "ready") -> dict:
    return {
        "id": worker_id,
        "role": "prefill",
        "model": "m",
        "region": "local",
        "address": f"127.0.0.1:{50000 + int(worker_id[1:])}",
        "state": state,
    }


class ControlPlaneStandIn:
    def __init__(self) -> None:
        self.workers: list[dict] = []
        self.down = False

    async def registry(self) -> dict:
        if self.down:
            raise ControlPlaneUnavailable("control plane unreachable")
        return {"models": [MODEL], "workers": self.workers}


@pytest.fixture
def control_plane():
    return ControlPlaneStandIn()


def ready_ids(registry: Registry) -> list[str]:
    return [w.id for w in registry.ready_workers("m", "prefill")]


async def test_a_worker_the_registry_omits_stays_ready_while_its_live_load_is_fresh(control_plane):
    alive = {"p1"}
    registry = Registry(control_plane, is_alive=lambda worker_id: worker_id in alive)
    control_plane.workers = [listed("p1"), listed("p2")]
    await registry.refresh()
    # Back from an outage, the control plane has not heard from either worker yet.
    control_plane.workers = []
    await registry.refresh()
    assert ready_ids(registry) == ["p1"]  # p2 is not seen alive by this gateway: dropped
    await registry.refresh()
    assert ready_ids(registry) == ["p1"]
    alive.clear()  # its stream went stale: the gateway lets it go
    await registry.refresh()
    assert ready_ids(registry) == []


async def test_a_worker_the_registry_calls_dead_but_the_gateway_sees_alive_stays_ready(control_plane):
    registry = Registry(control_plane, is_alive=lambda worker_id: True)
    control_plane.workers = [listed("p1")]
    await registry.refresh()
    control_plane.workers = [listed("p1", "dead")]
    await registry.refresh()
    assert ready_ids(registry) == ["p1"] and len(registry.workers) == 1


async def test_a_drain_the_registry_lists_is_honoured_at_once(control_plane):
    registry = Registry(control_plane, is_alive=lambda worker_id: True)
    control_plane.workers = [listed("p1")]
    await registry.refresh()
    control_plane.workers = [listed("p1", "draining")]
    await registry.refresh()
    assert ready_ids(registry) == []
    control_plane.workers = []  # a draining worker is never brought back as ready
    await registry.refresh()
    assert ready_ids(registry) == []


async def test_an_unreachable_control_plane_keeps_the_last_view(control_plane):
    registry = Registry(control_plane, is_alive=lambda worker_id: False)
    control_plane.workers = [listed("p1")]
    await registry.refresh()
    control_plane.down = True
    with pytest.raises(ControlPlaneUnavailable):
        await registry.refresh()
    assert ready_ids(registry) == ["p1"]


async def test_without_a_liveness_source_the_registry_is_followed_as_listed(control_plane):
    registry = Registry(control_plane)
    control_plane.workers = [listed("p1")]
    await registry.refresh()
    control_plane.workers = []
    await registry.refresh()
    assert ready_ids(registry) == []
