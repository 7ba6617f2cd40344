"""The control plane's verification answer, read defensively: what it does not send is allowed; the key
cache, bounded and least-recently-used, with refused keys apart; the per-peer failed-authentication
budget."""

import json

import pytest

from diptych_common.internal_api.client import ControlPlaneUnavailable
from gateway.accounts.auth import (
    FAILED_AUTH_BURST,
    FAILED_AUTH_PER_MINUTE,
    MAX_REFUSED_KEYS,
    REFUSED_TTL_S,
    Authenticator,
    RateLimits,
    caller_from_identity,
    check_allowed,
)
from gateway.accounts.auth_cache import peer_address
from gateway.types import ErrorKind, GatewayError, GenerationRequest, Priority
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, in_process_gateway, post_json

BASE = {"api_key_id": "key_1", "organization_id": "org_1"}


def test_an_answer_without_scopes_limits_or_spend_allows_everything():
    caller = caller_from_identity(BASE)
    assert caller.scopes is None and caller.key_limits == RateLimits() and not caller.spend.over_limit
    check_allowed(caller)


def test_only_the_control_planes_word_makes_a_caller_a_batch_runner():
    assert caller_from_identity(BASE).kind == "standard"
    assert caller_from_identity({**BASE, "kind": "batch"}).kind == "batch"
    assert caller_from_identity({**BASE, "kind": "something-else"}).kind == "standard"


RUNNER = {**BASE, "scopes": ["inference"], "kind": "batch", "batch_id": "batch_7"}


def batch_line(idempotency_key: str, priority: Priority = Priority.BATCH) -> GenerationRequest:
    return GenerationRequest(model="diptych-tiny", prompt="hi", idempotency_key=idempotency_key, priority=priority)


def test_a_batch_runner_key_sends_the_lines_of_its_batch_and_nothing_else():
    runner = caller_from_identity(RUNNER)
    assert runner.batch_id == "batch_7"
    check_allowed(runner, batch_line("batch-batch_7-0123abcd"))
    refused = [
        None,  # a call that sends no request: listing models
        batch_line(""),  # an ordinary request
        batch_line("batch-batch_7-0123abcd", Priority.INTERACTIVE),
        batch_line("batch-batch_8-0123abcd"),  # another batch's line
        batch_line("batch-batch_70-0123abcd"),
    ]
    for request in refused:
        with pytest.raises(GatewayError) as raised:
            check_allowed(runner, request)
        assert raised.value.kind is ErrorKind.PERMISSION_DENIED and "runner key" in raised.value.message
    with pytest.raises(GatewayError):  # a runner key the control plane names no batch for
        check_allowed(caller_from_identity({**RUNNER, "batch_id": None}), batch_line("batch--0123abcd"))
    check_allowed(caller_from_identity({**BASE, "batch_id": "batch_7"}), batch_line(""))  # a standard key


async def test_a_batch_runner_key_gets_a_json_403_for_an_interactive_chat_and_the_model_list(tmp_path):
    runner = ControlPlaneInMemory({"kind": "batch", "batch_id": "batch_7", "scopes": ["inference"]})
    async with in_process_gateway(tmp_path, runner) as gateway:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, answer = await post_json(gateway, "/v1/chat/completions", json.dumps(chat).encode())
        assert status == 403 and "runner key" in answer["error"]["message"]
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with gateway.http.get("/v1/models", headers=headers) as response:
            assert response.status == 403 and "runner key" in (await response.json())["error"]["message"]
    assert gateway.path.runs == 0


def test_limits_and_spend_are_read():
    caller = caller_from_identity(
        {
            **BASE,
            "scopes": ["inference"],
            "limits": {
                "organization": {"requests_per_minute": 60, "input_tokens_per_minute": None},
                "api_key": {"output_tokens_per_minute": 1000},
            },
            "spend": {"limit_micros": 5_000_000, "spent_micros": 10, "over_limit": False},
        }
    )
    assert caller.organization_limits == RateLimits(requests_per_minute=60)
    assert caller.key_limits == RateLimits(output_tokens_per_minute=1000)
    assert caller.spend.limit_micros == 5_000_000
    check_allowed(caller)


def test_a_key_without_the_inference_scope_is_denied():
    with pytest.raises(GatewayError) as raised:
        check_allowed(caller_from_identity({**BASE, "scopes": ["admin:read"]}))
    assert raised.value.kind is ErrorKind.PERMISSION_DENIED


def test_an_organization_over_its_spend_limit_is_refused_with_the_amount():
    with pytest.raises(GatewayError) as raised:
        check_allowed(
            caller_from_identity(
                {**BASE, "spend": {"limit_micros": 12_500_000, "spent_micros": 12_600_000, "over_limit": True}}
            )
        )
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert raised.value.message.startswith("spend limit of $12.50 reached for this billing period")


# ---- the key cache and the failed-authentication budget --------------------------------------------

GOOD_KEY = "dip_good"
PEER = "ipv4:10.0.0.7:51234"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ControlPlaneStandIn:
    """The control plane's verify answer from memory: valid keys, revocation, an outage, a call count."""

    def __init__(self) -> None:
        self.valid = {GOOD_KEY}
        self.down = False
        self.calls = 0

    async def verify_api_key(self, api_key: str) -> dict | None:
        self.calls += 1
        if self.down:
            raise ControlPlaneUnavailable("control plane unreachable")
        return {**BASE, "api_key_id": api_key} if api_key in self.valid else None


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def control_plane():
    return ControlPlaneStandIn()


@pytest.fixture
def auth(control_plane, clock):
    return Authenticator(control_plane, ttl_s=5.0, clock=clock)


async def refused_code(auth, key: str, peer: str) -> ErrorKind:
    with pytest.raises(GatewayError) as raised:
        await auth.authenticate_header(f"Bearer {key}", peer)
    return raised.value.kind


async def test_a_flood_of_bogus_keys_from_many_peers_does_not_evict_a_verified_key(auth, control_plane, clock):
    await auth.authenticate_header(f"Bearer {GOOD_KEY}", PEER)
    for index in range(MAX_REFUSED_KEYS + 50):
        clock.now += 0.0001
        assert (
            await refused_code(auth, f"bogus-{index}", f"ipv4:10.1.{index // 250}.{index % 250}:4000")
            is ErrorKind.UNAUTHENTICATED
        )
    control_plane.down = True
    clock.now += 10.0  # past the TTL, within the stale grace: served from the cache through the outage
    caller = await auth.authenticate_header(f"Bearer {GOOD_KEY}", PEER)
    assert caller.api_key_id == GOOD_KEY


async def test_verified_keys_are_evicted_least_recently_used_first(control_plane, clock, monkeypatch):
    monkeypatch.setattr("gateway.accounts.auth.MAX_CACHED_KEYS", 2)
    auth = Authenticator(control_plane, clock=clock)
    control_plane.valid |= {"k1", "k2", "k3"}
    for key in ("k1", "k2", "k1", "k3"):  # k2 is the least recently used when k3 arrives
        await auth.authenticate_header(f"Bearer {key}", PEER)
    control_plane.down = True
    assert (await auth.authenticate_header("Bearer k1", PEER)).api_key_id == "k1"
    assert (await auth.authenticate_header("Bearer k3", PEER)).api_key_id == "k3"
    assert await refused_code(auth, "k2", PEER) is ErrorKind.UNAVAILABLE


async def test_a_refused_key_is_remembered_briefly_then_asked_again(auth, control_plane, clock):
    assert await refused_code(auth, "later-valid", PEER) is ErrorKind.UNAUTHENTICATED
    assert await refused_code(auth, "later-valid", PEER) is ErrorKind.UNAUTHENTICATED
    assert control_plane.calls == 1
    control_plane.valid.add("later-valid")
    clock.now += REFUSED_TTL_S
    assert (await auth.authenticate_header("Bearer later-valid", PEER)).api_key_id == "later-valid"
    assert control_plane.calls == 2


async def test_a_revoked_key_stops_working_once_the_ttl_ends(auth, control_plane, clock):
    await auth.authenticate_header(f"Bearer {GOOD_KEY}", PEER)
    control_plane.valid.clear()
    clock.now += 4.9
    await auth.authenticate_header(f"Bearer {GOOD_KEY}", PEER)
    clock.now += 0.2
    assert await refused_code(auth, GOOD_KEY, PEER) is ErrorKind.UNAUTHENTICATED
    control_plane.down = True  # the refusal is remembered, not the old verification
    assert await refused_code(auth, GOOD_KEY, PEER) is ErrorKind.UNAUTHENTICATED


async def test_a_peer_over_its_failure_budget_is_refused_with_a_retry_time_before_any_control_plane_call(
    auth, control_plane, clock
):
    for index in range(FAILED_AUTH_BURST):
        assert await refused_code(auth, f"bogus-{index}", PEER) is ErrorKind.UNAUTHENTICATED
    calls = control_plane.calls
    # A new port is the same peer; an unknown key is not even sent to the control plane.
    with pytest.raises(GatewayError) as raised:
        await auth.authenticate_header("Bearer bogus-next", "ipv4:10.0.0.7:60000")
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "too many failed authentications from 10.0.0.7" in raised.value.message
    assert raised.value.retry_after_ms == round(60_000 / FAILED_AUTH_PER_MINUTE)
    assert control_plane.calls == calls
    # Another peer is untouched, and the budget refills with time.
    assert await refused_code(auth, "bogus-other", "ipv4:10.0.0.8:1") is ErrorKind.UNAUTHENTICATED
    clock.now += 60 / FAILED_AUTH_PER_MINUTE
    assert await refused_code(auth, "bogus-next", PEER) is ErrorKind.UNAUTHENTICATED


async def test_a_key_verified_within_the_ttl_passes_even_from_a_peer_over_its_budget(auth, control_plane):
    await auth.authenticate_header(f"Bearer {GOOD_KEY}", PEER)
    for index in range(FAILED_AUTH_BURST):
        await refused_code(auth, f"bogus-{index}", PEER)
    assert (await auth.authenticate_header(f"Bearer {GOOD_KEY}", PEER)).api_key_id == GOOD_KEY


@pytest.mark.parametrize(
    "peer, address",
    [
        ("ipv4:10.0.0.7:51234", "10.0.0.7"),
        ("ipv6:[::1]:51234", "::1"),
        ("ipv6:%5B2001:db8::1%5D:443", "2001:db8::1"),
        ("10.0.0.7", "10.0.0.7"),
        ("unix:/tmp/gateway.sock", "unix:/tmp/gateway.sock"),
    ],
)
def test_peers_are_counted_by_address_without_their_port(peer, address):
    assert peer_address(peer) == address
