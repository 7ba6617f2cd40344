"""Host identity, not reachability, decides whether KV goes through shared memory: two network namespaces
of one machine share /dev/shm and every file, yet each is a host of its own unless the operator gives
them one host id."""

import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from bench.hosts.network import Host, Network
from diptych_common.proto.v1 import worker_pb2
from tests.e2e.hosts.conftest import assert_nothing_left
from workers.kv_connector import host_identity
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender, peer_from_endpoint
from workers.kv_connector.shm import probe_matches
from workers.kv_connector.wire import dtype_name
from workers.runner.kv_pool import KvLayout

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


@contextmanager
def decode_endpoint(host: Host):
    """A KV receiver serving in the host's namespace; yields its endpoint (with its host id)."""
    serving = subprocess.Popen(
        host.command(sys.executable, "-m", "bench.hosts.path_choice", "serve", "--host", host.address),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=ENV,
        text=True,
    )
    try:
        yield serving.stdout.readline().strip()
    finally:
        serving.stdin.close()
        try:
            serving.wait(20)
        except subprocess.TimeoutExpired:
            serving.kill()
            serving.wait()


def paths_chosen(host: Host, endpoint: str, *host_ids: str) -> list[str]:
    """The path a sender in the host's namespace takes, per host id ("": the namespace's default)."""
    ids = [argument for host_id in host_ids for argument in ("--host-id", host_id)]
    chosen = subprocess.run(
        host.command(sys.executable, "-m", "bench.hosts.path_choice", "choose", endpoint, *ids),
        capture_output=True,
        env=ENV,
        text=True,
        timeout=120,
    )
    assert chosen.returncode == 0, chosen.stderr
    return chosen.stdout.split()


def host_id_in(host: Host, env: dict[str, str]) -> str:
    code = "from workers.kv_connector.host_identity import host_id; print(host_id())"
    return subprocess.run(
        host.command(sys.executable, "-c", code), capture_output=True, env=env, text=True, check=True, timeout=60
    ).stdout.strip()


LAYOUT = KvLayout(num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def test_a_readable_probe_is_not_enough_its_host_id_must_be_ours():
    receiver = KvReceiver(KvInbox(), LAYOUT, host_id="host-a")
    receiver.start()
    try:
        endpoint = worker_pb2.KvEndpoint(
            data_port=receiver.port,
            shm_probe_name=receiver.shm_probe_name,
            shm_probe_nonce=receiver.shm_probe_nonce,
            block_size=LAYOUT.block_size,
            dtype=dtype_name(LAYOUT.dtype),
        )
        assert probe_matches(receiver.shm_probe_name, receiver.shm_probe_nonce, "host-a")
        assert not probe_matches(receiver.shm_probe_name, receiver.shm_probe_nonce, "host-b")
        assert not probe_matches(receiver.shm_probe_name, receiver.shm_probe_nonce, "host-")  # no prefix match
        assert peer_from_endpoint("127.0.0.1:1", endpoint, LAYOUT, host_id="host-a").same_host
        assert not peer_from_endpoint("127.0.0.1:1", endpoint, LAYOUT, host_id="host-b").same_host
        assert (
            KvSender(LAYOUT, host_id="host-b")
            .path_to(peer_from_endpoint("127.0.0.1:1", endpoint, LAYOUT, host_id="host-b"), LAYOUT.block_nbytes)
            .data_path
            == "tcp"
        )
    finally:
        receiver.close()


@pytest.mark.usefixtures("namespaces")
def test_the_default_host_id_is_one_per_network_namespace():
    with Network(["a", "b"]) as network:
        a, b = network.hosts["a"], network.hosts["b"]
        ids = {host_id_in(a, ENV), host_id_in(a, ENV), host_id_in(b, ENV), host_identity.default_host_id()}
        assert len(ids) == 3  # both processes in a agree; b and the root namespace each differ
        assert host_id_in(a, {**ENV, host_identity.HOST_ID_ENV: "rack-7"}) == "rack-7"
    assert_nothing_left()


@pytest.mark.usefixtures("namespaces")
def test_one_namespace_takes_shm_another_never_unless_the_operator_gives_both_one_host_id():
    with Network(["a", "b"]) as network:
        a, b = network.hosts["a"], network.hosts["b"]
        with decode_endpoint(a) as endpoint:
            served = json.loads(endpoint)
            assert served["shm_probe_name"]  # its probe is in the /dev/shm b sees too
            assert paths_chosen(a, endpoint) == ["shm"]
            # b by default; b given a's host id (as an operator sets DIPTYCH_HOST_ID on both); b given another
            assert paths_chosen(b, endpoint, "", served["host_id"], "another-host") == ["tcp", "shm", "tcp"]
    assert_nothing_left()
