"""Every process of the platform listens only where it was told to: the live stack binds each part to
127.0.0.1, so no socket of any of them, the NIXL agents' UCX listeners of the prefill and decode workers
included, may listen on another interface of this host."""

import pytest

from tests.listening_sockets import listening_sockets, non_loopback_addresses_exist

pytestmark = pytest.mark.skipif(
    not non_loopback_addresses_exist(), reason="this host has no address beyond loopback to avoid"
)

LOOPBACK_ADDRESSES = {"127.0.0.1", "::1"}


def test_no_process_of_the_stack_listens_beyond_loopback(live):
    listening = {name: listening_sockets(process.pid) for name, process in live.stack.processes.items()}
    assert all(listening.values()), f"a process listens on nothing: {listening}"
    beyond = {name: sorted(s for s in sockets if s[0] not in LOOPBACK_ADDRESSES) for name, sockets in listening.items()}
    assert not any(beyond.values()), f"listening beyond loopback: {beyond}"


def test_the_workers_nixl_agents_listen_on_loopback(live):
    """The workers listen on more than their gRPC, metrics and KV data ports: their UCX listeners."""
    for name in ("prefill-0", "decode-0"):
        sockets = listening_sockets(live.stack.processes[name].pid)
        assert len(sockets) >= 3, f"{name} listens on {sorted(sockets)}"
