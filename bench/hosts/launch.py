"""The platform's processes started host by host: each worker and gateway inside its host's network
namespace (`ip netns exec`), bound to and advertising that host's address; the control plane in the root
namespace on the bridge's address, where PostgreSQL and Redis on loopback stay reachable to it.

`HostStack` is `diptych_server.stack.Stack` with those two differences; stopping, killing and restarting a
process work as they do there (a restarted process comes back in its namespace).
"""

import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.hosts.network import CONTROL_PLANE_ADDRESS, Host
from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_server.stack import REPO_ROOT, Stack, StackError

# Every host is a namespace of its own, so every process may take the same ports.
WORKER_PORT, KV_PORT, WORKER_METRICS_PORT = 7100, 7101, 7102
GATEWAY_PORT, GATEWAY_HTTP_PORT, GATEWAY_METRICS_PORT = 7200, 7201, 7202
KV_TIER_PORT = 7300
KV_TIER_MEMORY_MIB = 512
# Not handed to a process inside a namespace: REDIS_URL names the root namespace's loopback, which it cannot
# reach (without it the gateway keeps its rate-limit buckets in memory); UCX_NET_DEVICES is each worker's to
# derive from its own --host, and this process's may have been set to "lo" by a NIXL agent that ran in it (a
# test's in-process worker), which would keep every host's UCX off its link.
NOT_INHERITED = ("REDIS_URL", "UCX_NET_DEVICES")


@dataclass
class HostStack(Stack):
    host_of: dict[str, Host] = field(default_factory=dict)  # process name -> its host; absent: the root's

    @property
    def control_plane_url(self) -> str:
        return f"http://{CONTROL_PLANE_ADDRESS}:{self.control_plane_port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**extra)
        env["DIPTYCH_ALLOWED_HOSTS"] = f"{CONTROL_PLANE_ADDRESS},127.0.0.1,localhost"
        return env

    def host_env(self, **extra: str) -> dict[str, str]:
        """The environment of a process inside a host's namespace."""
        env = self.env(**extra)
        for variable in NOT_INHERITED:
            env.pop(variable, None)
        return env

    def start_control_plane(self, timeout: float = 60.0) -> None:
        self._spawn(
            "control-plane", ["control-plane", "--host", CONTROL_PLANE_ADDRESS, "--port", str(self.control_plane_port)]
        )
        self.wait_for_control_plane(timeout)

    def start_host_worker(self, host: Host, name: str, role: str, fleet_token: str, *extra: str) -> None:
        self.host_of[name] = host
        ports = ("--kv-port", str(KV_PORT), "--metrics-port", str(WORKER_METRICS_PORT))
        self.start_worker(name, role, fleet_token, WORKER_PORT, "--host", host.address, *ports, *extra)

    def start_host_gateway(self, host: Host, name: str, timeout: float = 60.0, *extra: str, mode: str = "split") -> str:
        """Starts a gateway (split by default) on the host; returns its gRPC address once it serves."""
        self.host_of[name] = host
        args = ["gateway", "--host", host.address, "--port", str(GATEWAY_PORT), "--mode", mode]
        args += ["--http-port", str(GATEWAY_HTTP_PORT), "--metrics-port", str(GATEWAY_METRICS_PORT), *extra]
        self._spawn(name, args)
        address = f"{host.address}:{GATEWAY_PORT}"
        self.wait_for_gateway(name, address, timeout)
        return address

    def start_host_kv_tier(self, host: Host, name: str) -> str:
        """Starts the shared KV tier's store on the host, bound to its address (memory only: a cache the
        harness throws away); returns HOST:PORT. It serves once it holds the worker RPC secret, which it
        asks of the control plane: `wait_until_serving`."""
        self.host_of[name] = host
        args = ["kv-tier", "--host", host.address, "--port", str(KV_TIER_PORT)]
        self._spawn(
            name, [*args, "--memory-mib", str(KV_TIER_MEMORY_MIB), "--control-plane-url", self.control_plane_url]
        )
        return f"{host.address}:{KV_TIER_PORT}"

    def wait_for_gateway(self, name: str, address: str, timeout: float = 60.0) -> None:
        self.wait_until_serving(name, address, timeout)

    def wait_until_serving(self, name: str, address: str, timeout: float = 60.0) -> None:
        """Until the process's gRPC health service says SERVING (a gateway, the KV tier's store)."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive(name)
                try:
                    response = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise StackError(f"{name} did not start serving within {timeout:.0f} s; see {self.log_path(name)}")

    def worker_load(self, address: str, timeout: float = 5.0) -> worker_pb2.Load:
        """A worker's load report (its KV bytes by data path among it), asked as the gateway asks."""
        with grpc.insecure_channel(address) as channel:
            return worker_pb2_grpc.WorkerStub(channel).GetLoad(
                worker_pb2.LoadRequest(), timeout=timeout, metadata=self._worker_credential()
            )

    def _worker_credential(self) -> tuple[tuple[str, str], ...]:
        response = httpx.get(
            f"{self.control_plane_url}/api/v1/internal/worker-credential",
            headers={"Authorization": f"Bearer {self.internal_token}"},
            timeout=5.0,
        )
        response.raise_for_status()
        return (("authorization", f"Bearer {response.json()['worker_rpc_secret']}"),)

    def _spawn(self, name: str, args: list[str], **env: str) -> None:
        host = self.host_of.get(name)
        if host is None:
            super()._spawn(name, args, **env)
            return
        if name in self.processes:
            raise StackError(f"a process named {name} is already running")
        self.launches[name] = (list(args), dict(env))
        process_env = self.host_env(**env)
        log_path = self.log_path(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.processes[name] = subprocess.Popen(
                host.command(sys.executable, "-m", "diptych_server.cli", *args),
                cwd=REPO_ROOT,
                env=process_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
