"""Faults between hosts, each made at the network or the process level of a host's namespace and undone
after `down_s`:

  link cut     the route between a prefill and a decode host dropped both ways (blackhole routes: no
               iptables or nft needed), mid-transfer; the gateway still reaches both
  host lost    every process in a host's namespace SIGKILLed, as when the machine dies; started again after
  partition    the gateway's host cut off from the control plane (its address blackholed), under load
"""

import contextlib
import os
import signal
import time
from dataclasses import dataclass

from bench.chaos.drain import spooled
from bench.hosts.fleet import KV_TIER_HOST, HostsPlatform
from bench.hosts.network import CONTROL_PLANE_ADDRESS, ip
from bench.progress import log

FAULTS = ("link-cut", "host-lost", "partition")


@dataclass
class FaultRecord:
    fault: str
    target: str
    started_at_s: float = 0.0
    ended_at_s: float = 0.0
    peak_spooled: float = 0.0  # a partition: the most usage events the gateway held back while it lasted


def cut_link(platform: HostsPlatform, prefill: str, decode: str) -> None:
    network = platform.network
    network.partition(prefill, network.hosts[decode].address)
    network.partition(decode, network.hosts[prefill].address)


def mend_link(platform: HostsPlatform, prefill: str, decode: str) -> None:
    network = platform.network
    network.heal(prefill, network.hosts[decode].address)
    network.heal(decode, network.hosts[prefill].address)


def kill_host(platform: HostsPlatform, host: str) -> None:
    """SIGKILL for everything running in the host's namespace; the stack forgets its processes there."""
    namespace = platform.network.hosts[host].namespace
    for name in [name for name, where in platform.stack.host_of.items() if where.namespace == namespace]:
        if name in platform.stack.processes:
            platform.stack.kill_process(name)
    for pid in ip("netns", "pids", namespace, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def restart_host(platform: HostsPlatform, host: str, timeout_s: float = 180.0) -> None:
    """Starts the host's processes again as they were; returns once each serves (a worker: registered
    anew, since the registry still lists the killed one as ready until its heartbeats are missed)."""
    stack = platform.stack
    names = [name for name, where in stack.host_of.items() if where.name == host]
    for name in names:
        stack.restart_process(name)
    for name in names:
        if name in platform.workers:
            platform.workers[name] = wait_for_new_registration(platform, name, timeout_s)
        elif name == KV_TIER_HOST:
            stack.wait_until_serving(name, platform.kv_tier_address, timeout_s)
        else:
            stack.wait_for_gateway(name, platform.gateway_address, timeout_s)


def wait_for_new_registration(platform: HostsPlatform, name: str, timeout_s: float) -> dict:
    old_id = platform.workers[name]["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        platform.stack._check_alive(name)
        for entry in platform.stack.registry().json()["workers"]:
            if entry["name"] == name and entry["id"] != old_id and entry["state"] == "ready":
                return entry
        time.sleep(0.3)
    raise TimeoutError(f"{name} did not register again within {timeout_s:.0f} s")


def partition_gateway(platform: HostsPlatform) -> None:
    platform.network.partition(platform.gateway_host, CONTROL_PLANE_ADDRESS)


def heal_gateway(platform: HostsPlatform) -> None:
    platform.network.heal(platform.gateway_host, CONTROL_PLANE_ADDRESS)


def peak_spooled_for(platform: HostsPlatform, seconds: float) -> float:
    """Samples the gateway's spooled usage events for `seconds`; returns the most seen."""
    peak, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, spooled(platform.metrics_urls) or 0.0)
        time.sleep(0.5)
    return peak


def run_fault(
    platform: HostsPlatform, fault: str, target: tuple[str, ...], down_s: float, started: float, restart: bool = True
) -> FaultRecord:
    """Makes the fault, holds it `down_s`, undoes it (blocking: run it on a thread beside the load). A lost
    host is started again only with `restart`."""
    record = FaultRecord(fault, "↔".join(target), time.monotonic() - started)
    log(f"{fault} {record.target} for {down_s:.0f} s")
    if fault == "link-cut":
        cut_link(platform, *target)
        time.sleep(down_s)  # the fault's duration: the load runs meanwhile
        mend_link(platform, *target)
    elif fault == "host-lost":
        kill_host(platform, target[0])
        time.sleep(down_s)
        if restart:
            restart_host(platform, target[0])
    elif fault == "partition":
        partition_gateway(platform)
        record.peak_spooled = peak_spooled_for(platform, down_s)
        heal_gateway(platform)
    else:
        raise ValueError(f"no fault named {fault}; one of {', '.join(FAULTS)}")
    record.ended_at_s = time.monotonic() - started
    log(f"{fault} {record.target} undone at {record.ended_at_s:.1f} s")
    return record
