"""The platform under test, on loopback: the control plane (SQLite), its jobs process, prefill and decode
workers of `diptych-tiny` and split gateways (two by default, as the chart runs them), started with
`diptych_server.stack.Stack`; and the
process-level moves the chaos run makes on it: kill one process, start it again as it was and wait until
it serves, revive what exited by itself, stop everything."""

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.chaos.database import create_organization
from bench.progress import log
from diptych_server.stack import UNLIMITED_NEW_ORGANIZATIONS, Stack, StackError, free_port

GATEWAY, CONTROL_PLANE, JOBS = "gateway", "control-plane", "jobs"
# The jobs process's batch runner: two lines of a batch at a time, and a lease short enough that a batch
# whose runner was killed resumes within seconds (the defaults, 30 s and 10 s, would outlast the run).
JOBS_ENV = {
    "DIPTYCH_BATCH_MAX_CONCURRENT_LINES": "2",
    "DIPTYCH_BATCH_LEASE_SECONDS": "3",
    "DIPTYCH_BATCH_RESUME_SECONDS": "1",
    "DIPTYCH_BATCH_SLICE_SECONDS": "5",
}
JOBS_READY = " ready."  # Celery's worker logs "celery@<host> ready." once it consumes tasks
SECOND_ORGANIZATION = ("Chaos B", "chaos-b")
READY_TIMEOUT_S = 180.0
POLL_S = 0.25

KV_PATH_WORKER_ARGS = {
    "shm": (),
    "nixl": ("--no-kv-shm", "--kv-nixl", "on"),
    "tcp": ("--no-kv-shm", "--kv-nixl", "off"),
}


@dataclass(frozen=True)
class GatewayPorts:
    grpc: int
    metrics: int
    http: int


@dataclass
class ChaosPlatform:
    stack: Stack
    api_keys: dict[str, str]  # organization id -> API key
    gateways: dict[str, GatewayPorts]  # name -> its ports
    workers: dict[str, list[str]]  # role -> worker names
    _replaced_ids: dict[str, str] = field(default_factory=dict)  # killed worker -> its registry id
    _jobs_log_offset: int = 0  # the jobs log's size when the jobs process was last killed

    @property
    def gateway_http_url(self) -> str:
        """The first gateway's HTTP API, where the jobs process sends the batches' lines."""
        return f"http://127.0.0.1:{next(iter(self.gateways.values())).http}/v1"

    @property
    def base_url(self) -> str:
        """Every gateway, as a client's base URL lists them."""
        return "grpc://" + ",".join(f"127.0.0.1:{ports.grpc}" for ports in self.gateways.values())

    @property
    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{ports.metrics}/metrics" for ports in self.gateways.values()]

    def names(self, kind: str) -> list[str]:
        if kind == GATEWAY:
            return list(self.gateways)
        return self.workers.get(kind) or [kind]

    def all_names(self) -> list[str]:
        jobs = [JOBS] if JOBS in self.stack.launches else []
        return [CONTROL_PLANE, *(n for names in self.workers.values() for n in names), *self.gateways, *jobs]

    def kill(self, name: str) -> None:
        if self._is_worker(name):
            self._replaced_ids[name] = self._registered_id(name)
        if name == JOBS:
            self._jobs_log_offset = self._jobs_log_size()
        self.stack.kill_process(name)

    def restart(self, name: str) -> None:
        """Starts the process again as it was started and waits until it serves."""
        self.stack.restart_process(name)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_running(name)
            if self._serves(name):
                return
            time.sleep(POLL_S)
        raise StackError(f"{name} did not serve again within {READY_TIMEOUT_S:.0f} s; see {self.stack.log_path(name)}")

    def revive_exited(self) -> list[str]:
        """Restarts every process that exited although nobody killed it; returns 'name (status)' of each."""
        exited = []
        for name in self.all_names():
            process = self.stack.processes.get(name)
            if process is not None and process.poll() is not None:
                exited.append(f"{name} (status {process.returncode})")
                log(f"{name} exited by itself with status {process.returncode}; restarting it")
                self.stack.processes.pop(name)
                if name == JOBS:
                    self._jobs_log_offset = self._jobs_log_size()
                self.restart(name)
        return exited

    def stop(self) -> None:
        """The gateways first, the workers side by side (each may take its grace period to drain), then the
        control plane and anything else `Stack.stop` knows."""
        for name in self.gateways:
            if name in self.stack.processes:
                self.stack.stop_process(name)
        workers = [name for names in self.workers.values() for name in names if name in self.stack.processes]
        with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
            list(pool.map(self.stack.stop_process, workers))
        self.stack.stop()

    def wait_for_jobs(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._jobs_ready():
            self._check_running(JOBS)
            if time.monotonic() > deadline:
                raise StackError(f"the jobs process did not start; see {self.stack.log_path(JOBS)}")
            time.sleep(POLL_S)

    def _is_worker(self, name: str) -> bool:
        return name not in (CONTROL_PLANE, JOBS, *self.gateways)

    def _serves(self, name: str) -> bool:
        if name == CONTROL_PLANE:
            return self._control_plane_ready()
        if name == JOBS:
            return self._jobs_ready()
        if name in self.gateways:
            return self._gateway_ready(self.gateways[name].grpc)
        return self._worker_registered_anew(name)

    def _jobs_log_size(self) -> int:
        path = self.stack.log_path(JOBS)
        return path.stat().st_size if path.exists() else 0

    def _jobs_ready(self) -> bool:
        """The restarted jobs process's Celery worker consumes tasks (its log since the kill says so)."""
        with open(self.stack.log_path(JOBS), "rb") as jobs_log:
            jobs_log.seek(self._jobs_log_offset)
            return JOBS_READY.encode() in jobs_log.read()

    def _check_running(self, name: str) -> None:
        code = self.stack.processes[name].poll()
        if code is not None:
            tail = self.stack.log_path(name).read_text(errors="replace")[-2000:]
            raise StackError(f"{name} exited with status {code} while restarting:\n{tail}")

    def _registry_workers(self) -> list[dict]:
        try:
            response = self.stack.registry()
        except httpx.TransportError:
            return []
        return response.json()["workers"] if response.status_code == 200 else []

    def _registered_id(self, name: str) -> str:
        return next((w["id"] for w in self._registry_workers() if w["name"] == name), "")

    def _worker_registered_anew(self, name: str) -> bool:
        old_id = self._replaced_ids.get(name, "")
        return any(w["name"] == name and w["state"] == "ready" and w["id"] != old_id for w in self._registry_workers())

    def _control_plane_ready(self) -> bool:
        try:
            return self.stack.registry().status_code == 200
        except httpx.TransportError:
            return False

    def _gateway_ready(self, port: int) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING


def start_platform(
    state_dir: Path, prefill_workers: int, decode_workers: int, jobs: bool, kv_path: str = "shm", gateways: int = 2
) -> ChaosPlatform:
    stack = Stack(
        state_dir,
        control_plane_port=free_port(),
        database_url=f"sqlite:///{state_dir / 'cp.sqlite3'}",
        extra_env=UNLIMITED_NEW_ORGANIZATIONS,
    )
    try:
        log("migrating the control plane's database; issuing the first organization's key")
        credentials = stack.prepare_control_plane(demo=True)
        second_id, second_key = create_organization(stack, *SECOND_ORGANIZATION)
        api_keys = {credentials.organization_id: credentials.api_key, second_id: second_key}
        log(f"starting the control plane on {stack.control_plane_url}")
        stack.start_control_plane()
        workers = {
            "prefill": [f"prefill-{i}" for i in range(prefill_workers)],
            "decode": [f"decode-{i}" for i in range(decode_workers)],
        }
        for role, names in workers.items():
            for name in names:
                stack.start_worker(
                    name, role, credentials.fleet_tokens[role], free_port(), *KV_PATH_WORKER_ARGS[kv_path]
                )
        ports = {f"{GATEWAY}-{i}": GatewayPorts(free_port(), free_port(), free_port()) for i in range(gateways)}
        log(
            f"starting {gateways} gateway(s) on 127.0.0.1:{', '.join(str(p.grpc) for p in ports.values())} (usage "
            f"spools under {state_dir}/gateway-N) while {prefill_workers} prefill and {decode_workers} decode "
            "workers load the model"
        )
        for name, gateway in ports.items():
            start_gateway(stack, state_dir, name, gateway)
        platform = ChaosPlatform(stack, api_keys, ports, workers)
        if jobs:
            log("starting the jobs process (batches run through the gateway's HTTP API)")
            stack.start_jobs(DIPTYCH_GATEWAY_URL=platform.gateway_http_url, **JOBS_ENV)
        stack.wait_for_workers([n for names in workers.values() for n in names], timeout=READY_TIMEOUT_S)
        if jobs:
            platform.wait_for_jobs()
    except BaseException:
        stack.stop()
        raise
    return platform


def start_gateway(stack: Stack, state_dir: Path, name: str, ports: GatewayPorts) -> None:
    """Every request takes the split path, so that killing a prefill worker always hits something."""
    stack.start_gateway(
        name,
        ports.grpc,
        ports.metrics,
        "split",
        http_port=ports.http,
        timeout=READY_TIMEOUT_S,
        extra=(
            "--state-dir",
            str(state_dir / name),
            "--skip-split-below",
            "0",
            "--prefill-overflow-tokens",
            "0",
        ),
    )
