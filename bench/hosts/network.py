"""Hosts as network namespaces: one namespace per host, each with a veth link to a bridge, on 10.77.0.0/24
(the root namespace is .1, hosts .2, .3, ...).

The bridge lives in a namespace of its own (the switch), which the root namespace joins by one more veth
link: traffic between two hosts is switched there and never crosses the root namespace, whose firewall
(with br_netfilter, the root's iptables FORWARD chain filters every bridged frame, and a container runtime
may set its policy to DROP) is the machine's, not the harness's.

Everything made here is named with PREFIX, so a run that died before its teardown is found and removed by
the next (`sweep_leftovers`). `Network` is a context manager; it also tears down on SIGTERM, SIGINT and
at exit, since a harness killed by Ctrl-C must not leave links and namespaces behind.

The control plane stays in the root namespace, bound to a second address of the root's link (.254): it
reaches PostgreSQL and Redis on loopback there, and every host reaches it through the switch, so nothing
outside loopback and the harness's own namespaces is ever addressed.
"""

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

PREFIX = "dxh"  # every namespace, link and bridge of the harness starts with it
BRIDGE = f"{PREFIX}-br"
SWITCH = f"{PREFIX}-switch"  # the namespace the bridge lives in
UPLINK = f"{PREFIX}-up"  # the root namespace's veth end, its peer on the bridge
SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.1"  # the root namespace's own address on the bridge: where clients come from
# The control plane's, a second address of the root's link: a host partitioned from it still reaches the root
# namespace's clients and they it.
CONTROL_PLANE_ADDRESS = f"{SUBNET}.254"
INNER_LINK = "eth0"  # the host's side of its veth, inside its namespace
COMMAND_TIMEOUT_S = 10.0


class NetworkError(RuntimeError):
    pass


def why_namespaces_cannot_be_made() -> str | None:
    """None where this process can make namespaces and links; otherwise the reason (for a skip)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def harness_namespaces() -> list[str]:
    listed = ip("netns", "list").stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def harness_links() -> list[str]:
    """Links of the root namespace made by the harness (its veth end to the switch)."""
    names = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()]
    return [name for name in names if name.startswith(PREFIX)]


def sweep_leftovers() -> list[str]:
    """Removes every namespace and link a previous run left, and SIGKILLs what still runs inside its
    namespaces (a namespace outlives its name while a process holds it); returns their names."""
    found = harness_namespaces() + harness_links()
    for namespace in harness_namespaces():
        for pid in ip("netns", "pids", namespace, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "delete", namespace, check=False)
    for link in harness_links():  # a veth whose namespace went is gone with it already
        ip("link", "delete", link, check=False)
    return found


@dataclass(frozen=True)
class Host:
    name: str  # the host's name in the harness: "gateway", "prefill-1", ...
    namespace: str
    address: str
    outer_link: str  # its veth end on the bridge, in the switch's namespace

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace (ip netns exec execs it: the pid is argv's own)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class Network:
    """Namespaces and links for `host_names`, made on enter, all removed on exit."""

    host_names: list[str]
    hosts: dict[str, Host] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)  # what an earlier run left, removed at start
    # run first on teardown: stopping the processes of the hosts before their namespaces go
    before_teardown: list[Callable[[], None]] = field(default_factory=list)
    _previous_handlers: dict[int, object] = field(default_factory=dict)

    def __enter__(self) -> "Network":
        self.leftovers = sweep_leftovers()
        self._install_teardown()
        try:
            self._make()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _make(self) -> None:
        ip("netns", "add", SWITCH)
        ip("-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", SWITCH, "link", "set", BRIDGE, "up")
        self._join(UPLINK, f"{PREFIX}-up-peer", namespace=None)
        ip("address", "add", f"{BRIDGE_ADDRESS}/24", "dev", UPLINK)
        ip("address", "add", f"{CONTROL_PLANE_ADDRESS}/24", "dev", UPLINK)  # secondary: never a source
        ip("link", "set", UPLINK, "up")
        for index, name in enumerate(self.host_names, start=2):
            host = Host(name, f"{PREFIX}-{index}", f"{SUBNET}.{index}", f"{PREFIX}-v{index}")
            ip("netns", "add", host.namespace)
            self._join(INNER_LINK, host.outer_link, namespace=host.namespace)
            ip("-n", host.namespace, "address", "add", f"{host.address}/24", "dev", INNER_LINK)
            ip("-n", host.namespace, "link", "set", INNER_LINK, "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
            self.hosts[name] = host

    @staticmethod
    def _join(inner: str, outer: str, namespace: str | None) -> None:
        """A veth pair: `outer` on the switch's bridge, `inner` in `namespace` (None: the root's)."""
        where = ["netns", namespace] if namespace else ["netns", "1"]  # pid 1's: the root namespace
        ip("-n", SWITCH, "link", "add", outer, "type", "veth", "peer", "name", inner, *where)
        ip("-n", SWITCH, "link", "set", outer, "master", BRIDGE)
        ip("-n", SWITCH, "link", "set", outer, "up")

    def teardown(self) -> None:
        """Stops what runs on the hosts, then removes every namespace and link of the harness (idempotent)."""
        callbacks, self.before_teardown = self.before_teardown, []
        try:
            for callback in callbacks:
                callback()
        finally:
            sweep_leftovers()
            self._restore_handlers()

    # ---- faults on the network --------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Takes the host's link down: nothing reaches it or leaves it until `mend`."""
        ip("-n", SWITCH, "link", "set", self.hosts[name].outer_link, "down")

    def mend(self, name: str) -> None:
        ip("-n", SWITCH, "link", "set", self.hosts[name].outer_link, "up")

    def partition(self, name: str, from_address: str) -> None:
        """Drops the host's packets to one address (a blackhole route: no iptables needed), while the rest
        of its traffic flows."""
        ip("-n", self.hosts[name].namespace, "route", "add", "blackhole", f"{from_address}/32")

    def heal(self, name: str, from_address: str) -> None:
        ip("-n", self.hosts[name].namespace, "route", "delete", "blackhole", f"{from_address}/32", check=False)

    # ---- teardown on signals ---------------------------------------------------------------------------

    def _install_teardown(self) -> None:
        atexit.register(self.teardown)
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: the context manager and atexit still tear down
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        previous = self._previous_handlers.get(signum)
        self.teardown()
        if callable(previous):
            previous(signum, frame)  # e.g. Python's own SIGINT handler: KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous_handlers.clear()
        atexit.unregister(self.teardown)
