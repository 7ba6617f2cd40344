"""`diptych up`, the README's first command, run as a newcomer runs it: on the embedded default."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import diptych

from tests.e2e.conftest import free_port

READY_LINE = "Ctrl-C stops it"


def processes_with_state_dir(state_dir: Path) -> list[int]:
    marker = f"DIPTYCH_STATE_DIR={state_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_up_runs_the_platform_serves_a_request_and_stops_everything_on_ctrl_c(tmp_path):
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DIPTYCH_SECRET_KEY", "CELERY_BROKER_URL")}
    gateway_port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "diptych_server.cli", "up", "--state-dir", str(state_dir),
         "--control-plane-port", str(free_port()), "--gateway-port", str(gateway_port),
         "--metrics-port", str(free_port()), "--http-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in up.stdout], daemon=True).start()
    output = []
    try:
        deadline = time.monotonic() + 180
        while not any(READY_LINE in line for line in output):
            assert up.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "".join(output)
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        text = "".join(output)
        assert "[5/5]" in text and "usage: " in text and "completion tokens" in text
        assert (state_dir / "controlplane.sqlite3").is_file()

        credentials = dict(line.split("=", 1) for line in (state_dir / "env").read_text().split())
        assert credentials["DIPTYCH_BASE_URL"] == f"grpc://127.0.0.1:{gateway_port}"
        with diptych.Client(api_key=credentials["DIPTYCH_API_KEY"], base_url=credentials["DIPTYCH_BASE_URL"]) as client:
            completion = client.completions.create(model="diptych-tiny", prompt="hello", max_tokens=5, temperature=0)
        assert completion.usage.completion_tokens == 5
        # Control plane, jobs, two workers and the gateway, each found by its environment.
        assert len(processes_with_state_dir(state_dir.resolve())) >= 5
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
        assert up.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while processes_with_state_dir(state_dir.resolve()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_state_dir(state_dir.resolve()) == []
