"""What a process on one of the harness's hosts inherits from the process that starts it."""

from bench.hosts.fleet import HOST_ENV
from bench.hosts.launch import HostStack


def test_a_host_process_derives_its_own_ucx_devices_and_never_inherits_the_starters(monkeypatch, tmp_path):
    """A NIXL agent that ran in the starting process (a test's in-process worker on 127.0.0.1) leaves
    UCX_NET_DEVICES=lo in its environment; inherited, it kept every host's UCX off its link, and every
    split request across hosts failed (CI: the four multi-host tests, after the in-process NIXL tests)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    env = HostStack(tmp_path, extra_env=HOST_ENV).host_env(DIPTYCH_FLEET_TOKEN="t")
    assert "UCX_NET_DEVICES" not in env and "REDIS_URL" not in env
    assert env["UCX_TLS"] == "tcp" and env["DIPTYCH_FLEET_TOKEN"] == "t"
