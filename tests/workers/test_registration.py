"""A heartbeat answered with "draining" makes the worker drain, and it reports draining from then on."""

import json

import httpx

from diptych_common.internal_api.client import ControlPlaneClient
from workers.serving.registration import ControlPlaneLink


async def test_a_draining_answer_drains_the_worker_and_is_reported_back():
    reported, told = [], []

    def control_plane(request: httpx.Request) -> httpx.Response:
        reported.append(json.loads(request.content)["state"])
        return httpx.Response(200, json={"state": "draining"})

    link = ControlPlaneLink(
        "http://control-plane", "fleet-token", "127.0.0.1:1", "w", lambda: {"queue_depth": 0}, on_state=told.append
    )
    link._control_plane = ControlPlaneClient(
        "http://control-plane", "fleet-token", transport=httpx.MockTransport(control_plane)
    )
    link.worker_id = "wrk_1"
    await link.heartbeat()
    assert link.draining and told == ["draining"]
    await link.heartbeat()
    assert reported == ["ready", "draining"]
    await link.close()
