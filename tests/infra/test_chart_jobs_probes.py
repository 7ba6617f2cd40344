"""The jobs Deployment's probes check the Celery worker itself. Its command, run as the kubelet runs it (in the
container's environment, within the probe's timeout), answers 0 from a running `diptych jobs` and fails when that
process hangs or when the answer would come from another node. The process here runs on the embedded default
(SQLite and the broker-less transport under a state directory of its own); the chart's is the same command on
its broker. The database is left unmigrated: the tasks beat sends fail, which is not what the probe asks about.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from tests.infra.chart import RELEASE, REPO, default_objects

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
START_TIMEOUT_S = 90
READY_LINE = " ready."  # Celery's "celery@<node> ready." once its consumer runs


def _jobs_container() -> dict:
    (jobs,) = [d for d in default_objects() if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-jobs"]
    (container,) = jobs["spec"]["template"]["spec"]["containers"]
    return container


def _reply_timeout_s(command: list[str]) -> float:
    words = command[-1].split()
    return float(words[words.index("--timeout") + 1])


def test_the_jobs_pod_is_probed_by_one_command_with_room_for_a_batch_slice():
    container = _jobs_container()
    assert all(kind in container for kind in PROBES), sorted(container)
    (command,) = {tuple(container[kind]["exec"]["command"]) for kind in PROBES}
    reply_s = _reply_timeout_s(list(command))
    for kind in PROBES:
        probe = container[kind]
        assert probe["timeoutSeconds"] > reply_s, f"{kind}: the kubelet gives up before the command does"
        # The pool is solo: a slice of a batch holds the worker that long without answering.
        silence_s = probe["periodSeconds"] * probe.get("failureThreshold", 3)
        assert silence_s > settings.DIPTYCH_BATCH_SLICE_SECONDS + reply_s, kind
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > readiness["periodSeconds"] * readiness.get(
        "failureThreshold", 3
    ), "a worker is restarted only after it has been unready for a while"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """`diptych jobs` on the embedded default, and the environment its container would have."""
    tmp_path = tmp_path_factory.mktemp("jobs")
    embedded = ("DATABASE_URL", "CELERY_BROKER_URL")
    env = {key: value for key, value in os.environ.items() if key not in embedded}
    env |= {
        "DIPTYCH_STATE_DIR": str(tmp_path / "state"),
        "DIPTYCH_SECRET_KEY": "jobs-probe-test",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}",  # celery, as in the image
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp_path / "jobs.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "diptych_server.cli", "jobs"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY_LINE not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"jobs not ready in {START_TIMEOUT_S} s"
            time.sleep(0.2)
        yield process, env
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # its session: beat's process too (SIGKILL ends a stopped one)
        process.wait()


def _probe(env: dict[str, str], timeout_s: float) -> int:
    """The probes' command as the kubelet runs it; its exit status, which must come within `timeout_s`."""
    return _run_probe(env, timeout_s)[0]


def _run_probe(env: dict[str, str], timeout_s: float) -> tuple[int, int]:
    """The probe's exit status and the most memory it held (bytes), measured by a parent of its own."""
    command = _jobs_container()["livenessProbe"]["exec"]["command"]
    measure = (
        "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    done = subprocess.run(
        [sys.executable, "-c", measure, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    code, peak = done.stdout.split()[-2:]
    return int(code), int(peak)


def test_the_probe_passes_on_a_running_worker_and_fails_on_a_hung_one_or_another_node(jobs, tmp_path):
    process, env = jobs
    timeout_s = _jobs_container()["livenessProbe"]["timeoutSeconds"]
    assert _probe(env, timeout_s) == 0

    elsewhere = tmp_path / "elsewhere"  # a `hostname` naming another node: the answer must come from this one
    elsewhere.mkdir()
    (elsewhere / "hostname").write_text("#!/bin/sh\necho another-node\n")
    (elsewhere / "hostname").chmod(0o755)
    assert _probe({**env, "PATH": f"{elsewhere}{os.pathsep}{env['PATH']}"}, timeout_s) != 0

    process.send_signal(signal.SIGSTOP)  # hung: alive, but its consumer loop runs no more
    try:
        assert _probe(env, timeout_s) != 0
    finally:
        process.send_signal(signal.SIGCONT)


def test_the_jobs_memory_limit_holds_the_worker_and_a_probe_with_room_to_spare(jobs):
    """The worker, beat's process and one probe beside them, as measured here, take under half the limit: the
    rest is for the work (a batch slice's lines in flight)."""
    process, env = jobs
    code, probe_bytes = _run_probe(env, _jobs_container()["livenessProbe"]["timeoutSeconds"])
    assert code == 0
    worker_bytes = sum(_rss_bytes(pid) for pid in _session(process.pid))
    limit = _jobs_container()["resources"]["limits"]["memory"]
    assert limit.endswith(("Mi", "Gi")), limit
    limit_bytes = int(limit[:-2]) * (2**20 if limit.endswith("Mi") else 2**30)
    print(f"jobs: worker and beat {worker_bytes / 2**20:.0f} MiB, a probe {probe_bytes / 2**20:.0f} MiB, limit {limit}")
    assert worker_bytes + probe_bytes < limit_bytes / 2, (worker_bytes, probe_bytes, limit)


def _session(leader: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == leader:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
