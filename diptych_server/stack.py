"""Starts and stops the platform's processes on this machine: the control plane, workers and gateways.

`diptych up` runs it on the embedded default; the end-to-end tests run it against their own database.
Each process logs to its own file under the state directory.
"""

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diptych_common.internal_api.endpoints import REGISTRY
from diptych_common.supervision import supervisor_env

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bootstrap_arguments(demo: bool, staff_email: str = "", staff_password: str = "") -> list[str]:
    """The bootstrap command's arguments. Values go as `--name=value`: a random password may start with
    '-', which a separate argument would make look like an option."""
    arguments = ["--json"] + (["--demo"] if demo else [])
    if staff_email:
        arguments += [f"--staff-email={staff_email}", f"--staff-password={staff_password}"]
    return arguments


# The environment under which every new organization starts without rate limits (the control plane's
# DIPTYCH_DEFAULT_*_PER_MINUTE): the benchmarks measure serving, not the rate limiter.
UNLIMITED_NEW_ORGANIZATIONS = {
    f"DIPTYCH_DEFAULT_{kind}_PER_MINUTE": "unlimited" for kind in ("REQUESTS", "INPUT_TOKENS", "OUTPUT_TOKENS")
}


class StackError(RuntimeError):
    pass


@dataclass
class Credentials:
    api_key: str
    organization_id: str
    fleet_tokens: dict[str, str]
    dashboard_email: str = ""  # the demo owner, who signs in to /dashboard/
    dashboard_password: str = ""
    staff_email: str = ""  # a staff user for the dashboard's fleets and workers (made for `diptych up` only)
    staff_password: str = ""


@dataclass
class Stack:
    state_dir: Path
    control_plane_port: int = 8000
    database_url: str | None = None
    internal_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(50))
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    launches: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)  # name -> (args, env)
    # Its processes stop when the process that started them dies (supervision.py): `diptych up` sets it; the
    # tests do not, since the thread that starts a process may end long before the process should.
    supervised: bool = False
    # More environment for every process and command of this stack: e.g. the artifact store's settings.
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def control_plane_url(self) -> str:
        return f"http://127.0.0.1:{self.control_plane_port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DIPTYCH_INTERNAL_TOKEN=self.internal_token,
            DIPTYCH_SECRET_KEY=self.secret_key,
            DIPTYCH_CONTROL_PLANE_URL=self.control_plane_url,
            DIPTYCH_STATE_DIR=str(self.state_dir.resolve()),
            PYTHONUNBUFFERED="1",
        )
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        env.update(self.extra_env)
        env.update(extra)
        return env

    def prepare_control_plane(self, *, demo: bool = True, staff_email: str = "") -> Credentials:
        """Migrates the database and issues the demo API key and fresh fleet tokens; with `staff_email`, also
        sets a fresh password on that staff user (creating it)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._manage("migrate", "--noinput")
        staff_password = secrets.token_urlsafe(12) if staff_email else ""
        output = json.loads(self._manage("bootstrap", *bootstrap_arguments(demo, staff_email, staff_password)))
        return Credentials(
            output.get("api_key", ""),
            output["organization_id"],
            output["fleet_tokens"],
            output.get("dashboard_email", ""),
            output.get("dashboard_password", ""),
            output.get("staff_email", ""),
            staff_password,
        )

    def prepare_region(self, region: str, hardware_class: str = "cpu") -> dict[str, str]:
        """Ensures the fleets of another region (or hardware class) after `prepare_control_plane`; returns
        their fresh tokens by role."""
        output = self._manage("bootstrap", "--json", f"--region={region}", f"--hardware-class={hardware_class}")
        return json.loads(output)["fleet_tokens"]

    def start_control_plane(self, timeout: float = 60.0) -> None:
        self._spawn("control-plane", ["control-plane", "--port", str(self.control_plane_port)])
        self.wait_for_control_plane(timeout)

    def wait_for_control_plane(self, timeout: float = 60.0) -> None:
        """Returns once the control plane (started or restarted by this stack) answers its registry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive("control-plane")
            try:
                if self.registry().status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise StackError(
            f"the control plane did not answer within {timeout:.0f} s; see {self.log_path('control-plane')}"
        )

    def start_jobs(self, **env: str) -> None:
        """The Celery worker with beat; DIPTYCH_GATEWAY_URL in `env` names the gateway batches run through."""
        self._spawn("jobs", ["jobs"], **env)

    def start_worker(self, name: str, role: str, fleet_token: str, port: int, *extra: str) -> None:
        self._spawn(
            name,
            ["worker", "--role", role, "--port", str(port), "--name", name, *extra],
            DIPTYCH_FLEET_TOKEN=fleet_token,
        )

    def start_gateway(
        self,
        name: str,
        port: int,
        metrics_port: int,
        mode: str = "auto",
        timeout: float = 60.0,
        http_port: int = 8080,
        extra: tuple[str, ...] = (),
        **env: str,
    ) -> None:
        self._spawn(
            name,
            [
                "gateway",
                "--port",
                str(port),
                "--http-port",
                str(http_port),
                "--metrics-port",
                str(metrics_port),
                "--mode",
                mode,
                *extra,
            ],
            **env,
        )
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
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
        raise StackError(f"the gateway {name} did not start within {timeout:.0f} s; see {self.log_path(name)}")

    def wait_for_workers(self, names: list[str], timeout: float = 120.0) -> list[dict]:
        """Waits until every named worker is registered and ready; returns their registry entries."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in names:
                self._check_alive(name)
            workers = {w["name"]: w for w in self.registry().json()["workers"] if w["state"] == "ready"}
            if all(name in workers for name in names):
                return [workers[name] for name in names]
            time.sleep(0.3)
        raise StackError(f"workers {names} did not become ready within {timeout:.0f} s; see {self.state_dir}/logs")

    def registry(self) -> httpx.Response:
        return httpx.get(
            self.control_plane_url + REGISTRY.path,
            headers={"Authorization": f"Bearer {self.internal_token}"},
            timeout=5.0,
        )

    def log_path(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def stop_process(self, name: str, sig: int = signal.SIGTERM) -> None:
        self._stop_together([name], sig)

    def kill_process(self, name: str) -> None:
        """SIGKILL for the process and everything it started (its session: gunicorn's workers too), as when
        its machine dies: nothing of it gets to flush, drain or say goodbye."""
        _kill_session(self.processes.pop(name))

    def restart_process(self, name: str) -> None:
        """Starts a stopped process again with the arguments and environment it was last started with.
        Waiting until it is ready is the caller's part: each kind of process is ready in its own way."""
        if name not in self.launches:
            raise StackError(f"{name} was never started by this stack; start it with start_worker/start_gateway/...")
        args, env = self.launches[name]
        self._spawn(name, args, **env)

    def stop(self) -> None:
        """Stops every process: gateways first (they hold streams open on the workers, which would keep
        a draining worker waiting), then workers and jobs, the control plane last so that the others
        can report to it. The processes of one tier stop together."""

        def tier(name: str) -> int:
            return 0 if name.startswith("gateway") else 2 if name == "control-plane" else 1

        for level in (0, 1, 2):
            self._stop_together([name for name in self.processes if tier(name) == level])

    def _stop_together(self, names: list[str], sig: int = signal.SIGTERM) -> None:
        """Signals each process, waits up to STOP_TIMEOUT_S for all of them, then SIGKILLs the session of any
        still running. Whatever each one started in its session (gunicorn's workers, Celery's beat) goes too."""
        processes = [self.processes.pop(name) for name in names]
        for process in processes:
            if process.poll() is None:
                process.send_signal(sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
            _kill_session(process)  # a straggler, or what a stopped process left behind in its session

    def _spawn(self, name: str, args: list[str], **env: str) -> None:
        if name in self.processes:
            raise StackError(f"a process named {name} is already running")
        self.launches[name] = (list(args), dict(env))
        log_path = self.log_path(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "diptych_server.cli", *args],
                cwd=REPO_ROOT,
                env=self.env(**(supervisor_env() if self.supervised else {}), **env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _check_alive(self, name: str) -> None:
        code = self.processes[name].poll()
        if code is not None:
            tail = self.log_path(name).read_text(errors="replace")[-3000:]
            raise StackError(f"{name} exited with status {code}:\n{tail}")

    def _manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / "manage.py"), *args],
            cwd=REPO_ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise StackError(f"manage.py {' '.join(args)} failed:\n{result.stderr[-3000:]}")
        return result.stdout


def _kill_session(process: subprocess.Popen) -> None:
    """SIGKILL for every process in the session `process` leads (started with start_new_session, the
    session's and group's id is its pid; Linux keeps that id unused while any member lives), then reaps it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
