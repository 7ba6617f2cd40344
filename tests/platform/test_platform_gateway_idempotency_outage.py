"""A gateway cut off from the control plane goes on serving requests with an idempotency key: it claims,
stores and frees keys alone, with the control plane's meaning within the gateway, and hands every key over
once the control plane answers again, frees first. The control plane runs behind a relay the test cuts
(connections refused, open ones closed) and mends."""

import asyncio
import dataclasses
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest
from prometheus_client import REGISTRY

from diptych_common.internal_api.client import ControlPlaneClient
from diptych_server.stack import free_port
from gateway.accounts.auth import Caller
from gateway.accounts.idempotency import IdempotencyKeys
from gateway.accounts.usage import UsageJournal
from gateway.types import ErrorKind, GatewayError
from tests.platform.conftest import INTERNAL_TOKEN
from tests.platform.test_platform_gateway_idempotency import LEASE_S, REQUEST, answers, execution

pytestmark = pytest.mark.django_db(transaction=True)

HANDOVER_WAIT_S = 15.0


class Relay:
    """The control plane as one gateway reaches it: through a relay that can be cut and mended."""

    def __init__(self, target_url: str) -> None:
        address = urlsplit(target_url)
        self._target = (address.hostname, address.port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._relays: set[asyncio.Task] = set()

    async def mend(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._relays, return_exceptions=True)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        self._relays.add(relay)
        server_reader, server_writer = await asyncio.open_connection(*self._target)
        self._writers |= {client_writer, server_writer}
        try:
            await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))
        finally:
            self._writers -= {client_writer, server_writer}
            self._relays.discard(relay)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
def caller(org_a) -> Caller:
    return Caller(organization_id=org_a.public_id, api_key_id="key_owner")


@pytest.fixture
async def relay(live_server):
    relay = Relay(live_server.url)
    await relay.mend()
    yield relay
    await relay.cut()


@pytest.fixture
def quick_handover(monkeypatch):
    monkeypatch.setattr("gateway.accounts.outage_claims.HANDOVER_RETRY_S", 0.1)


def gateway(url: str, tmp_path, name: str) -> IdempotencyKeys:
    return IdempotencyKeys(ControlPlaneClient(url, INTERNAL_TOKEN, timeout=2.0), UsageJournal(tmp_path / name))


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.02)


async def test_a_gateway_cut_off_claims_stores_and_hands_over_a_key_alone(
    relay, live_server, caller, tmp_path, quick_handover
):
    cut_off = gateway(relay.url, tmp_path, "cut-off")
    await relay.cut()
    claims = metric("diptych_gateway_idempotency_outage_claims_total")
    assert await cut_off.claim(caller, "k", REQUEST, execution(1), LEASE_S) is None
    assert metric("diptych_gateway_idempotency_outage_claims_total") == claims + 1
    with pytest.raises(GatewayError) as running:
        await cut_off.claim(caller, "k", REQUEST, execution(2), LEASE_S)
    assert running.value.kind is ErrorKind.ABORTED
    await cut_off.complete(caller.organization_id, "k", execution(1), answers(choices=2, tokens=3, top=1))

    replay = await cut_off.claim(caller, "k", REQUEST, execution(3), LEASE_S)
    assert replay is not None and [output.text for output in replay] == ["tok" * 3] * 2
    with pytest.raises(GatewayError, match="another API key") as other_key:
        await cut_off.claim(dataclasses.replace(caller, api_key_id="key_other"), "k", REQUEST, execution(4), 60)
    assert other_key.value.kind is ErrorKind.INVALID_ARGUMENT
    with pytest.raises(GatewayError, match="different parameters"):
        await cut_off.claim(caller, "k", dataclasses.replace(REQUEST, prompt="other"), execution(5), LEASE_S)

    await relay.mend()
    await cut_off.wait_idle(HANDOVER_WAIT_S)
    assert metric("diptych_gateway_idempotency_keys_held_alone") == 0
    another = gateway(live_server.url, tmp_path, "another")
    replay = await another.claim(caller, "k", REQUEST, execution(6), LEASE_S)
    assert replay is not None and replay[0].text == "tok" * 3


async def test_a_key_freed_in_an_outage_is_free_at_the_control_plane_before_its_next_claim_arrives(
    relay, live_server, caller, tmp_path, quick_handover
):
    """Claimed at the control plane, its execution fails in the outage and a retry runs under the key in
    the outage too: the free is handed over first, so the retry's claim finds the key free, not a conflict."""
    cut_off = gateway(relay.url, tmp_path, "cut-off")
    assert await cut_off.claim(caller, "retried", REQUEST, execution(1), LEASE_S) is None
    await relay.cut()
    cut_off.release(caller.organization_id, "retried", execution(1))
    await until(lambda: metric("diptych_gateway_idempotency_keys_held_alone") == 1)  # the release met the cut
    assert await cut_off.claim(caller, "retried", REQUEST, execution(2), LEASE_S) is None
    await cut_off.complete(caller.organization_id, "retried", execution(2), answers(choices=1, tokens=2, top=0))

    conflicts = metric("diptych_gateway_idempotency_handover_conflicts_total")
    await relay.mend()
    await cut_off.wait_idle(HANDOVER_WAIT_S)
    assert metric("diptych_gateway_idempotency_handover_conflicts_total") == conflicts
    replay = await gateway(live_server.url, tmp_path, "another").claim(
        caller, "retried", REQUEST, execution(3), LEASE_S
    )
    assert replay is not None and replay[0].text == "tok" * 2  # the retry's answer


async def test_an_answer_that_cannot_be_stored_in_an_outage_waits_in_the_gateway_not_freed(
    relay, live_server, caller, tmp_path, quick_handover
):
    """Claimed at the control plane before the cut, completed after it: the answer reaches the control
    plane after the outage; meanwhile its key is still running to everyone, this gateway too."""
    cut_off = gateway(relay.url, tmp_path, "cut-off")
    assert await cut_off.claim(caller, "late", REQUEST, execution(1), LEASE_S) is None
    await relay.cut()
    await cut_off.complete(caller.organization_id, "late", execution(1), answers(choices=1, tokens=4, top=0))
    with pytest.raises(GatewayError) as waiting:
        await cut_off.claim(caller, "late", REQUEST, execution(2), LEASE_S)
    assert waiting.value.kind is ErrorKind.ABORTED

    await relay.mend()
    await cut_off.wait_idle(HANDOVER_WAIT_S)
    replay = await cut_off.claim(caller, "late", REQUEST, execution(3), LEASE_S)
    assert replay is not None and replay[0].text == "tok" * 4


async def test_a_key_another_gateway_took_during_the_outage_is_a_counted_conflict(
    relay, live_server, caller, tmp_path, quick_handover
):
    cut_off, reachable = gateway(relay.url, tmp_path, "cut-off"), gateway(live_server.url, tmp_path, "reachable")
    await relay.cut()
    assert await reachable.claim(caller, "twice", REQUEST, execution(1), LEASE_S) is None
    await reachable.complete(caller.organization_id, "twice", execution(1), answers(choices=1, tokens=1, top=0))
    assert await cut_off.claim(caller, "twice", REQUEST, execution(2), LEASE_S) is None
    await cut_off.complete(caller.organization_id, "twice", execution(2), answers(choices=1, tokens=5, top=0))

    conflicts = metric("diptych_gateway_idempotency_handover_conflicts_total")
    await relay.mend()
    await cut_off.wait_idle(HANDOVER_WAIT_S)
    assert metric("diptych_gateway_idempotency_handover_conflicts_total") == conflicts + 1
    replay = await cut_off.claim(caller, "twice", REQUEST, execution(3), LEASE_S)
    assert replay is not None and replay[0].text == "tok"  # the control plane's record stands


async def test_a_resume_in_an_outage_is_refused_as_unavailable_and_leaves_no_outage_behind(
    relay, live_server, caller, tmp_path
):
    journal = UsageJournal(tmp_path / "cut-off")
    cut_off = IdempotencyKeys(ControlPlaneClient(relay.url, INTERNAL_TOKEN, timeout=2.0), journal)
    await relay.cut()
    resume = dataclasses.replace(REQUEST, resume_request_id=execution(1))
    with pytest.raises(GatewayError, match="control plane unreachable") as refused:
        await cut_off.claim(caller, "resumed", resume, execution(2), LEASE_S)
    assert refused.value.kind is ErrorKind.UNAVAILABLE and journal.held_idempotency_keys() == []

    await relay.mend()
    assert await cut_off.claim(caller, "fresh", REQUEST, execution(3), LEASE_S) is None
    with pytest.raises(GatewayError) as held_there:  # claimed at the control plane, not in the gateway
        await gateway(live_server.url, tmp_path, "another").claim(caller, "fresh", REQUEST, execution(4), LEASE_S)
    assert held_there.value.kind is ErrorKind.ABORTED
