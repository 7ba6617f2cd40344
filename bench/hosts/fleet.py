"""The whole platform across hosts: a gateway host, two prefill hosts and two decode hosts, each a network
namespace on the harness's bridge, and the control plane on the bridge's address in the root namespace;
on request, the shared KV tier's store on a host of its own (.7) that every worker is pointed at.
`multi_host_platform` starts it and, however it is left (an error, Ctrl-C, SIGTERM), stops every process
and removes every namespace and link."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.hosts.launch import GATEWAY_METRICS_PORT, HostStack
from bench.hosts.network import Network
from diptych_server.stack import UNLIMITED_NEW_ORGANIZATIONS, Credentials, free_port

GATEWAY = "gateway"
PREFILL_HOSTS = ("prefill-1", "prefill-2")
DECODE_HOSTS = ("decode-1", "decode-2")
HOST_NAMES = [GATEWAY, *PREFILL_HOSTS, *DECODE_HOSTS]
KV_TIER_HOST = "kv-tier"  # after the others: 10.77.0.7
READY_TIMEOUT_S = 180.0
# The hosts share one kernel: left to itself UCX sees one node and moves NIXL's bytes through shared
# memory, so the link (and a fault on it) would never be exercised. Real hosts need no such setting.
HOST_ENV = {"UCX_TLS": "tcp", **UNLIMITED_NEW_ORGANIZATIONS}


@dataclass
class HostsPlatform:
    network: Network
    stack: HostStack
    credentials: Credentials
    gateway_address: str  # HOST:PORT of the gateway's gRPC API
    workers: dict[str, dict]  # worker name (= its host's name) -> registry entry
    kv_tier_address: str = ""  # HOST:PORT of the shared KV tier's store every worker uses; empty: none

    gateway_host: str = GATEWAY

    @property
    def base_url(self) -> str:
        return f"grpc://{self.gateway_address}"

    @property
    def api_keys(self) -> dict[str, str]:
        """Organization id -> API key: the demo organization's."""
        return {self.credentials.organization_id: self.credentials.api_key}

    @property
    def metrics_urls(self) -> list[str]:
        address = self.network.hosts[self.gateway_host].address
        return [f"http://{address}:{GATEWAY_METRICS_PORT}/metrics"]

    def gateway_metric(self, name: str) -> float:
        """The sum of a gateway metric's series (0 where it has none)."""
        text = httpx.get(self.metrics_urls[0], timeout=5.0).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)

    def kv_blocks_in_use(self) -> dict[str, int]:
        """KV blocks each worker holds now (0 everywhere once every request has ended and been freed)."""
        held = {}
        for name, entry in self.workers.items():
            load = self.stack.worker_load(entry["address"])
            held[name] = load.kv_blocks_total - load.kv_blocks_free
        return held

    def kv_bytes_by_path(self, name: str) -> dict[str, int]:
        """What a worker moved, by data path: a prefill worker's bytes sent, a decode worker's received."""
        load = self.stack.worker_load(self.workers[name]["address"])
        by_path = load.kv_bytes_sent_by_path if name in PREFILL_HOSTS else load.kv_bytes_received_by_path
        return dict(by_path)


@contextmanager
def multi_host_platform(
    state_dir: Path,
    database_url: str | None = None,
    worker_args: tuple[str, ...] = (),
    colocated: bool = False,
    kv_tier: bool = False,
) -> Iterator[HostsPlatform]:
    """One worker per prefill and decode host, `worker_args` added to each (e.g. `--kv-nixl off`).
    `colocated`: the same four hosts each run a colocated worker (both phases, no KV hand-off) behind a
    colocated gateway, for comparison with the split fleet. `kv_tier`: the shared KV tier's store runs on a
    host of its own and every worker is started with `--kv-tier` pointing at its address."""
    with Network(HOST_NAMES + ([KV_TIER_HOST] if kv_tier else [])) as network:
        stack = HostStack(state_dir, control_plane_port=free_port(), database_url=database_url, extra_env=HOST_ENV)
        network.before_teardown.append(stack.stop)
        credentials = stack.prepare_control_plane(demo=True)
        stack.start_control_plane()
        tier_address = ""
        if kv_tier:
            tier_address = stack.start_host_kv_tier(network.hosts[KV_TIER_HOST], KV_TIER_HOST)
            worker_args = (*worker_args, "--kv-tier", tier_address)
        for name in (*PREFILL_HOSTS, *DECODE_HOSTS):
            role = "colocated" if colocated else name.split("-")[0]
            stack.start_host_worker(network.hosts[name], name, role, credentials.fleet_tokens[role], *worker_args)
        if kv_tier:  # while the workers load their model
            stack.wait_until_serving(KV_TIER_HOST, tier_address, READY_TIMEOUT_S)
        names = [*PREFILL_HOSTS, *DECODE_HOSTS]
        workers = dict(zip(names, stack.wait_for_workers(names, READY_TIMEOUT_S), strict=True))
        mode = "colocated" if colocated else "split"
        gateway = stack.start_host_gateway(network.hosts[GATEWAY], GATEWAY, READY_TIMEOUT_S, mode=mode)
        yield HostsPlatform(network, stack, credentials, gateway, workers, tier_address)
