"""The harness's namespaces and links: made, reachable from each other, and gone after every way out."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from bench.hosts.network import PREFIX, Network, harness_namespaces, ip
from tests.e2e.hosts.conftest import assert_nothing_left

pytestmark = pytest.mark.usefixtures("namespaces")


def test_hosts_reach_each_other_over_the_bridge_and_nothing_is_left_after():
    with Network(["a", "b"]) as network:
        a, b = network.hosts["a"], network.hosts["b"]
        listener = subprocess.Popen(
            b.command(sys.executable, "-c", LISTEN.format(address=b.address)), stdout=subprocess.PIPE, text=True
        )
        try:
            assert listener.stdout.readline().strip() == "listening"
            sent = subprocess.run(
                a.command(sys.executable, "-c", SEND.format(address=b.address)), capture_output=True, timeout=20
            )
            assert sent.returncode == 0, sent.stderr
            assert listener.wait(20) == 0 and listener.stdout.read().strip() == "got hello"
        finally:
            listener.kill()
            listener.wait()
        network.cut("b")  # its link down: a cannot reach it any more
        cut = subprocess.run(a.command(sys.executable, "-c", SEND.format(address=b.address)), capture_output=True)
        assert cut.returncode != 0
    assert_nothing_left()


def root_forward_policy() -> str:
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
    return rules.splitlines()[0].split()[-1]  # "-P FORWARD ACCEPT"


@pytest.mark.skipif(shutil.which("iptables") is None, reason="needs iptables (apt-get install -y iptables)")
def test_hosts_reach_each_other_whatever_the_root_namespaces_firewall_forwards():
    """A container runtime on the machine sets the root namespace's FORWARD policy to DROP, and with
    br_netfilter that chain filters every frame a bridge in the root namespace switches: the hosts' traffic
    must not cross it."""
    policy = root_forward_policy()
    subprocess.run(["iptables", "-P", "FORWARD", "DROP"], check=True)
    try:
        test_hosts_reach_each_other_over_the_bridge_and_nothing_is_left_after()
    finally:
        subprocess.run(["iptables", "-P", "FORWARD", policy], check=True)


def test_leftovers_of_an_earlier_run_are_removed_and_reported():
    stale = f"{PREFIX}-99"
    ip("netns", "add", stale)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        with Network(["a"]) as network:
            assert stale in network.leftovers
            assert stale not in harness_namespaces()
            assert sleeper.wait(10) == -signal.SIGKILL  # what ran in it went with it
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        sleeper.wait()
    assert_nothing_left()


def test_an_error_inside_tears_everything_down():
    with pytest.raises(RuntimeError, match="boom"), Network(["a", "b"]):
        raise RuntimeError("boom")
    assert_nothing_left()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_harness_stopped_by_a_signal_leaves_nothing(signum):
    harness = subprocess.Popen(
        [sys.executable, "-c", HOLD],
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its KeyboardInterrupt's traceback
        text=True,
    )
    try:
        assert harness.stdout.readline().strip() == "up"
        assert len(harness_namespaces()) == 3  # the two hosts and the switch
        harness.send_signal(signum)
        assert harness.wait(20) != 0
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
    assert_nothing_left()


LISTEN = textwrap.dedent("""
    import socket
    server = socket.create_server(("{address}", 7000))
    print("listening", flush=True)
    server.settimeout(20)
    conn, _ = server.accept()
    print("got", conn.recv(16).decode())
""")
SEND = textwrap.dedent("""
    import socket
    with socket.create_connection(("{address}", 7000), timeout=3) as conn:
        conn.sendall(b"hello")
""")
HOLD = textwrap.dedent("""
    import time
    from bench.hosts.network import Network
    with Network(["a", "b"]):
        print("up", flush=True)
        time.sleep(60)
""")
