"""`python -m bench.chaos` end to end, briefly: real processes on loopback, a few seconds of load from two
organizations, one SIGKILL of the gateway and its restart on the same state directory, then the ledger
read and reconciled. It checks that the run works and that its verdict follows its own figures; the
figures themselves (usage lost at a gateway kill, today) are the run's to report, not this test's."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from diptych_server.stack import REPO_ROOT, Stack, StackError, free_port

RUN_TIMEOUT_S = 400
GONE_WITHIN_S = 0.5  # SIGKILL takes effect at once; an orphaned gunicorn worker notices its parent in ~1 s


def test_a_brief_chaos_run_kills_the_gateway_once_and_reconciles_the_ledger(tmp_path):
    report_path, state_dir = tmp_path / "chaos.json", tmp_path / "state"
    command = [
        sys.executable,
        "-m",
        "bench.chaos",
        "--duration",
        "5",
        "--clients-per-org",
        "1",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--victims",
        "gateway",
        "--no-batches",
        "--max-kills",
        "1",
        "--kill-interval",
        "1.5",
        "1.5",
        "--down-time",
        "0.2",
        "0.2",
        "--max-tokens",
        "16",
        "32",
        "--progress-every",
        "2",
        "--drain-timeout",
        "60",
        "--state-dir",
        str(state_dir),
        "--json",
        str(report_path),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert result.returncode in (0, 1) and report_path.exists(), result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    ledger = report["ledger"]

    assert report["kills"] == {"prefill": 0, "decode": 0, "gateway": 1, "control-plane": 0, "jobs": 0}
    assert report["batches"] is None
    kill = report["timeline"][0]
    assert kill["name"] in ("gateway-0", "gateway-1") and kill["back_at_s"] > kill["killed_at_s"]
    assert report["organizations"] == 2 and report["drained"]
    assert report["completed_after_last_restart"] > 0, "no request completed after the gateway's restart"
    assert ledger["completed"] > 0 and ledger["delivered_tokens"] > 0 and ledger["ledger_events"] > 0
    assert ledger["completed"] + ledger["errored"] == ledger["requests_sent"]
    failed = ledger["lost"] or ledger["doubled"] or ledger["overbilled"] or ledger["misattributed"]
    assert result.returncode == (1 if failed else 0)
    retries = [line for line in result.stderr.splitlines() if line.startswith("Retrying request")]
    assert ledger["errored_before_any_token"] == 0, (
        f"a request that got no token failed: {report['error_messages']}; the clients' retries: {retries}"
    )
    assert "| requests sent |" in result.stdout
    assert "| kills per victim kind | prefill 0, decode 0, gateway 1, control-plane 0, jobs 0 |" in result.stdout
    _assert_every_process_stopped(state_dir)


def test_a_brief_chaos_run_with_batches_kills_the_jobs_process_and_reconciles_every_batch_line(tmp_path):
    """Batches submitted (some cancelled) while the jobs process that runs them is killed and restarted:
    every batch ends, every line is reported once, and the verdict follows the batch figures too."""
    report_path, state_dir = tmp_path / "chaos.json", tmp_path / "state"
    command = [
        *(sys.executable, "-m", "bench.chaos", "--duration", "8", "--clients-per-org", "1"),
        *("--prefill-workers", "1", "--decode-workers", "1", "--victims", "jobs", "--max-kills", "1"),
        *("--kill-interval", "4", "4", "--down-time", "0.5", "0.5", "--max-tokens", "8", "16"),
        *("--batch-every", "1", "2", "--batch-lines", "4", "6", "--batch-max-tokens", "8", "16"),
        *("--cancel-share", "0.5", "--batch-timeout", "120", "--progress-every", "2", "--drain-timeout", "60"),
        *("--state-dir", str(state_dir), "--json", str(report_path)),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert result.returncode in (0, 1) and report_path.exists(), result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    batches = report["batches"]

    assert report["kills"] == {"prefill": 0, "decode": 0, "gateway": 0, "control-plane": 0, "jobs": 1}
    kill = report["timeline"][0]
    assert kill["name"] == "jobs" and kill["back_at_s"] > kill["killed_at_s"]
    assert report["drained"] and report["batches_submitted"] >= 2
    assert batches["batches"] >= report["batches_submitted"] and batches["lines"] >= 8
    assert batches["answered"] > 0 and batches["billed_executions"] > 0
    not_run = sum(batches["not_run"].values())
    assert batches["answered"] + batches["refused"] + not_run + batches["absent"] == batches["lines"]
    failed = any(batches[figure] for figure in ("lost", "doubled", "misattributed", "billed_not_reported", "unended"))
    failed = failed or any(report["ledger"][figure] for figure in ("lost", "doubled", "misattributed"))
    assert result.returncode == (1 if failed else 0), result.stdout
    assert "| **billed but not reported** (executions no line names) |" in result.stdout
    assert "| kills per victim kind | prefill 0, decode 0, gateway 0, control-plane 0, jobs 1 |" in result.stdout
    _assert_every_process_stopped(state_dir)


def test_kill_process_leaves_nothing_of_the_control_plane_and_restart_process_serves_again(tmp_path):
    stack = Stack(tmp_path, control_plane_port=free_port(), database_url=f"sqlite:///{tmp_path / 'cp.sqlite3'}")
    try:
        stack.prepare_control_plane()
        stack.start_control_plane()
        first_pid = stack.processes["control-plane"].pid
        assert len(_processes_started_by(tmp_path)) >= 3, "gunicorn's master and its workers"

        stack.kill_process("control-plane")
        assert _gone_within(tmp_path, GONE_WITHIN_S) == [], "a process of the killed control plane lives on"
        with pytest.raises(httpx.TransportError):
            stack.registry()

        stack.restart_process("control-plane")
        stack.wait_for_control_plane()
        assert stack.processes["control-plane"].pid != first_pid
        assert "--port" in stack.launches["control-plane"][0]
    finally:
        stack.stop()


def test_restart_process_refuses_a_name_it_never_started(tmp_path):
    with pytest.raises(StackError, match="gateway-x was never started by this stack"):
        Stack(tmp_path).restart_process("gateway-x")


def _gone_within(state_dir: Path, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (alive := _processes_started_by(state_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _processes_started_by(state_dir: Path) -> list[str]:
    """Live processes (zombies have no environment left) with the stack's state directory in their
    environment: everything a Stack started, and what those started in turn."""
    marker = f"DIPTYCH_STATE_DIR={state_dir.resolve()}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                found.append(environ.parent.name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _assert_every_process_stopped(state_dir: Path) -> None:
    """Nothing the run started outlives it, gunicorn's workers included."""
    leftovers = _processes_started_by(state_dir)
    assert not leftovers, f"processes {leftovers} outlived the chaos run"
