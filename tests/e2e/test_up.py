"""`diptych up`, the README's first command, run as a newcomer runs it: on the embedded default.

`up` is started the way a shell starts a background job (SIGINT ignored) in a session of its own, so that
the test can signal it alone; whatever happens, the test kills everything `up` started before it ends.
Its processes are found by pid (the descendants of `up`, each with its start time, so that a recycled
pid is not taken for a survivor) and, as a second net, by the state directory in their environment.
"""

import contextlib
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import diptych
from diptych_common.internal_api.endpoints import REGISTRY
from diptych_server.cli import _parser
from diptych_server.stack import REPO_ROOT, free_port
from tests.e2e.waiting import wait_for

READY_LINE = "Ctrl-C stops it"
GATEWAY_STARTING_LINE = "[4/5]"
DASHBOARD_LINE = re.compile(r"dashboard: (?P<url>http://\S+)/dashboard/ \(sign in as")
STAFF_LINE = re.compile(r"fleets and workers: .*\(sign in as (?P<email>\S+), password (?P<password>[^\s)]+)\)")
WORKER_METRICS = re.compile(r"(?P<url>http://127\.0\.0\.1:\d+/metrics) \((?P<name>prefill-0|decode-0)\)")
SPLIT_USAGE = re.compile(
    r"usage: (\d+) prompt tokens, (\d+) completion tokens \(prefill on prefill-0, (\d+) KV bytes sent to decode on "
    r"decode-0\)"
)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[2] == started and stat[1] != "Z"


class Up:
    """One `diptych up`, its output on a pipe that the test reads and may close."""

    def __init__(self, tmp_path: Path) -> None:
        self.state_dir = (tmp_path / "state").resolve()
        self.gateway_port = free_port()
        embedded = ("DATABASE_URL", "DIPTYCH_SECRET_KEY", "CELERY_BROKER_URL")  # up runs on its embedded default
        env = {k: v for k, v in os.environ.items() if k not in embedded}
        read_end, write_end = os.pipe()
        ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec, as by `up &` in a script
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "diptych_server.cli",
                    "up",
                    "--state-dir",
                    str(self.state_dir),
                    "--control-plane-port",
                    str(free_port()),
                    "--gateway-port",
                    str(self.gateway_port),
                    "--metrics-port",
                    str(free_port()),
                    "--http-port",
                    str(free_port()),
                ],
                stdout=write_end,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            signal.signal(signal.SIGINT, ignored)
            os.close(write_end)
        self._output = read_end
        self.output = ""
        self.started: dict[int, int] = {}  # pid -> start time, of every process `up` started

    def read_until(self, text: str, seconds: float = 240) -> str:
        deadline = time.monotonic() + seconds
        while text not in self.output:
            assert time.monotonic() < deadline, f"no {text!r} from diptych up in {seconds} s:\n{self.output}"
            ready, _, _ = select.select([self._output], [], [], 1.0)
            if ready:
                chunk = os.read(self._output, 65536)
                assert chunk, f"diptych up exited with {self.process.wait()}:\n{self.output}"
                self.output += chunk.decode(errors="replace")
        return self.output

    def close_output(self) -> None:
        """Nobody reads `up`'s output any more: its next print meets a broken pipe."""
        if self._output is not None:
            os.close(self._output)
            self._output = None

    def record_descendants(self) -> dict[int, int]:
        """Every process below `up` now, by pid, with its start time."""
        parents: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                parents.setdefault(stat[0], []).append(int(entry.name))
        pending = list(parents.get(self.process.pid, []))
        while pending:
            pid = pending.pop()
            if (stat := _stat(pid)) is not None:
                self.started[pid] = stat[2]
                pending.extend(parents.get(pid, []))
        return self.started

    def survivors(self) -> list[int]:
        """Processes `up` started that still run: those recorded by pid, and any other whose environment
        names this platform's state directory."""
        alive = {pid for pid, started in self.started.items() if _alive(pid, started)}
        marker = f"DIPTYCH_STATE_DIR={self.state_dir}".encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0") and _stat(int(entry.name))[1] != "Z":
                        alive.add(int(entry.name))
                except (OSError, TypeError):
                    continue
        return sorted(alive)

    def kill_everything(self) -> None:
        self.close_output()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # `up` leads a session of its own
        for pid in self.survivors():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def up(tmp_path):
    launched = Up(tmp_path)
    try:
        yield launched
    finally:
        launched.kill_everything()


def _assert_all_stopped(up: Up, seconds: float) -> None:
    assert len(up.started) >= 4, f"the control plane, jobs and two workers at least, found {up.started}"
    assert wait_for(lambda: not up.survivors(), seconds=seconds), f"still running: {up.survivors()}\n{up.output}"


def test_up_runs_the_platform_split_serves_a_request_and_stops_everything_on_ctrl_c(up):
    text = up.read_until(READY_LINE)
    assert "[5/5]" in text and "Traceback" not in text
    usage = SPLIT_USAGE.search(text)
    assert usage, f"the demo request did not run split:\n{text}"
    prompt_tokens, completion_tokens, kv_bytes = map(int, usage.groups())
    assert prompt_tokens > 32 and completion_tokens > 0 and kv_bytes > 0
    assert (up.state_dir / "controlplane.sqlite3").is_file()

    credentials = dict(line.split("=", 1) for line in (up.state_dir / "env").read_text().split())
    assert credentials["DIPTYCH_BASE_URL"] == f"grpc://127.0.0.1:{up.gateway_port}"
    internal = {"Authorization": f"Bearer {credentials['DIPTYCH_INTERNAL_TOKEN']}"}  # what `model register` uses
    assert httpx.get(credentials["DIPTYCH_CONTROL_PLANE_URL"] + REGISTRY.path, headers=internal).status_code == 200
    with diptych.Client(api_key=credentials["DIPTYCH_API_KEY"], base_url=credentials["DIPTYCH_BASE_URL"]) as client:
        completion = client.completions.create(model="diptych-tiny", prompt="hello", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5
    summary = up.read_until("fleets and workers: ")
    _assert_the_printed_staff_user_sees_the_workers(summary)
    _assert_each_worker_serves_the_metrics_of_the_demo_s_hand_off(summary, kv_bytes)
    up.record_descendants()

    os.killpg(up.process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
    assert up.process.wait(timeout=60) == 0, up.read_until("stopping every process")
    _assert_all_stopped(up, seconds=5)


def _assert_the_printed_staff_user_sees_the_workers(text: str) -> None:
    """`up` prints a staff user (of this machine's platform only) who signs in and sees fleets and workers."""
    dashboard, staff = DASHBOARD_LINE.search(text), STAFF_LINE.search(text)
    assert dashboard and staff, f"up printed no dashboard or staff sign-in:\n{text}"
    with httpx.Client(base_url=f"{dashboard['url']}/api/v1", timeout=10) as session:
        signed_in = session.post("/auth/login", json={"email": staff["email"], "password": staff["password"]})
        assert signed_in.status_code == 200, signed_in.text
        assert signed_in.json()["user"]["is_staff"]
        workers = session.get("/workers").json()["data"]
    assert {worker["name"] for worker in workers if worker["state"] == "ready"} == {"prefill-0", "decode-0"}


def _assert_each_worker_serves_the_metrics_of_the_demo_s_hand_off(text: str, kv_bytes: int) -> None:
    """`up` prints where each worker serves Prometheus metrics, and there the demo's KV hand-off shows: the
    prefill worker sent the bytes the usage line names, the decode worker received them."""
    urls = {match["name"]: match["url"] for match in WORKER_METRICS.finditer(text)}
    assert set(urls) == {"prefill-0", "decode-0"}, f"up printed no metrics address per worker:\n{text}"
    sent = _counter(urls["prefill-0"], "diptych_worker_kv_sent_bytes", "prefill")
    received = _counter(urls["decode-0"], "diptych_worker_kv_received_bytes", "decode")
    assert sent >= kv_bytes and received >= kv_bytes, (sent, received, kv_bytes)


def _counter(metrics_url: str, name: str, role: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(f'{name}_total{{role="{role}"')]
    return float(value)


def test_up_stops_everything_on_sigterm_when_nobody_reads_its_output(up):
    up.read_until(READY_LINE)
    up.record_descendants()
    up.close_output()
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=60) == 0
    _assert_all_stopped(up, seconds=5)


def test_a_killed_up_takes_its_processes_with_it(up):
    up.read_until(GATEWAY_STARTING_LINE)  # control plane, jobs and workers running; the gateway starting
    up.record_descendants()
    up.process.kill()
    up.process.wait()
    _assert_all_stopped(up, seconds=30)


def test_make_up_passes_the_readme_s_arguments_to_diptych_up():
    readme = (REPO_ROOT / "README.md").read_text()
    documented = re.search(r'^make up ARGS="([^"]+)"', readme, re.MULTILINE)
    assert documented, 'the README shows no `make up ARGS="..."`'
    plan = subprocess.run(
        ["make", "-n", "up", f"ARGS={documented.group(1)}"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    (command,) = [shlex.split(line) for line in plan.splitlines() if re.search(r"\bdiptych up\b", line)]
    assert command[command.index("up") + 1 :] == shlex.split(documented.group(1))
    _parser().parse_args(command[command.index("up") :])  # every documented option exists
