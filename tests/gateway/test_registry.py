"""The gateway's registry view through control-plane outages: workers it sees alive itself stay
routable while the control plane cannot be reached or has not heard from them yet; drains are honoured.
Models carry when the catalog added them, which `GET /v1/models` answers as `created`."""

import dataclasses
import time
from datetime import UTC, datetime

import pytest

from diptych_common.internal_api.client import ControlPlaneUnavailable
from gateway.fleet.registry import Registry
from tests.gateway.harness import API_KEY, MODEL_CREATED_AT, in_process_gateway

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
        self.model = MODEL
        self.workers: list[dict] = []
        self.down = False

    async def registry(self) -> dict:
        if self.down:
            raise ControlPlaneUnavailable("control plane unreachable")
        return {"models": [self.model], "workers": self.workers}


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


class PublishedModel(ControlPlaneStandIn):
    """A control plane whose one model is published as artifacts, at `revision`."""

    def __init__(self) -> None:
        super().__init__()
        self.revision = "r1"

    async def registry(self) -> dict:
        model = {"name": "m", "source": "artifacts", "context_length": 64, "revision": self.revision}
        return {"models": [model], "workers": self.workers}


async def test_a_published_model_s_tokenizer_comes_from_its_revision_s_files_once_per_revision(tmp_path):
    control_plane = PublishedModel()
    fetched: list[str] = []
    failing = False

    def tokenizer_files(model: str) -> str:
        if failing:
            raise OSError("the store is unreachable")
        fetched.append(control_plane.revision)
        return str(tmp_path / model / control_plane.revision)

    registry = Registry(control_plane, tokenizer_files=tokenizer_files)
    await registry.refresh()
    await registry.refresh()
    assert registry.models["m"].source == str(tmp_path / "m" / "r1")
    assert fetched == ["r1"]  # not again while the revision stays

    control_plane.revision = "r2"
    failing = True
    await registry.refresh()
    assert registry.models["m"].revision == "r1"  # the new files cannot be had yet: the last revision serves on
    failing = False
    await registry.refresh()
    assert (registry.models["m"].revision, registry.models["m"].source) == ("r2", str(tmp_path / "m" / "r2"))
    assert fetched == ["r1", "r2"]


async def test_a_published_model_whose_files_were_never_fetched_stays_out_of_the_view():
    def unreachable(model: str) -> str:
        raise OSError("the store is unreachable")

    registry = Registry(PublishedModel(), tokenizer_files=unreachable)
    await registry.refresh()
    assert registry.models == {}


async def test_a_model_is_created_when_the_catalog_added_it(control_plane):
    registry = Registry(control_plane)
    control_plane.model = {**MODEL, "created_at": "2025-03-04T05:06:07.890000Z"}
    await registry.refresh()
    assert registry.models["m"].created == int(datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC).timestamp())


async def test_a_control_plane_that_does_not_say_gives_the_time_this_gateway_first_listed_it(control_plane):
    registry = Registry(control_plane)
    before = int(time.time())
    await registry.refresh()
    first = registry.models["m"].created
    assert before <= first <= time.time()
    registry.models["m"] = dataclasses.replace(registry.models["m"], created=first - 100)  # listed long ago
    await registry.refresh()
    assert registry.models["m"].created == first - 100


async def test_the_models_list_answers_when_the_catalog_added_each_model(tmp_path):
    created = int(datetime.fromisoformat(MODEL_CREATED_AT).timestamp())
    async with in_process_gateway(tmp_path) as gateway:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with gateway.http.get("/v1/models", headers=headers) as response:
            (model,) = (await response.json())["data"]
        async with gateway.http.get(f"/v1/models/{model['id']}", headers=headers) as response:
            assert (await response.json())["created"] == model["created"] == created
