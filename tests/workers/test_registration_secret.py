"""Registration hands the worker its RPC secret; a control plane that hands out none is refused clearly."""

import httpx
import pytest

from diptych_common.internal_api.client import ControlPlaneClient
from workers.serving.registration import ControlPlaneLink, RegistrationError

FLEET = {"name": "tiny-decode", "role": "decode", "model": "diptych-tiny"}


def link_answering(body: dict) -> ControlPlaneLink:
    link = ControlPlaneLink("http://control-plane", "fleet-token", "127.0.0.1:1", "w", dict)
    link._control_plane = ControlPlaneClient(
        "http://control-plane",
        "fleet-token",
        transport=httpx.MockTransport(lambda request: httpx.Response(201, json=body)),
    )
    return link


async def test_registration_hands_over_the_worker_rpc_secret():
    link = link_answering({"id": "wrk_1", "fleet": FLEET, "heartbeat_interval_seconds": 2, "worker_rpc_secret": "s3"})
    assert not link.secret.known
    await link.register()
    assert link.secret.known and link.secret.refusal((("authorization", "Bearer s3"),)) is None
    await link.close()


async def test_a_control_plane_without_a_secret_is_refused_with_the_reason():
    link = link_answering({"id": "wrk_1", "fleet": FLEET, "heartbeat_interval_seconds": 2})
    with pytest.raises(RegistrationError, match="no worker RPC secret"):
        await link.register()
    assert not link.secret.known and link.worker_id == ""  # nothing taken from the answer
    await link.close()
