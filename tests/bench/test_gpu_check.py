"""`bash bench/gpu_check.sh`, proved on the CPU: its smoke mode runs the preflight and then every step to rc=0
(diptych-tiny, a few requests, the triton steps under Triton's interpreter); a failing preflight stops the run
before any step; limits over the budget refuse to start; and the kernel tests' gate fails a run in which no
test passed or any was skipped, which pytest itself reports as a success."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diptych_server.stack import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "gpu_check.sh"
STEPS = ["preflight", "kernel", "floor", "serving", "split", "parity", "parity-shm", "busy", "costs"]
SMOKE_TIMEOUT_S = 960  # the smoke run's own budget is 900 s; on 2 idle cores it takes about 2 minutes


def run_script(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "OUT": str(out), **env},
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )


def summary_of(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("== summary ("))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start + 1 : end]


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)  # past the suite's 600 s: on cores other work shares it takes minutes
def test_the_smoke_run_runs_the_preflight_and_then_every_step_to_rc_0(tmp_path):
    result = run_script(tmp_path, "--smoke")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # the steps ran with Django hidden, as the GPU machine has none: no step started the control plane
    hidden = {**os.environ, "PYTHONPATH": str(tmp_path / "hidden")}
    django = subprocess.run([sys.executable, "-c", "import django"], env=hidden, capture_output=True, text=True)
    assert django.returncode == 1 and "no Django on the GPU machine" in django.stderr
    summary = summary_of(result.stdout)
    assert [line.split(":")[0] for line in summary] == STEPS
    assert all(re.fullmatch(r"[\w-]+: rc=0 in \d+ s", line) for line in summary), summary
    assert (tmp_path / "gpu-check.txt").read_text().count("== summary (") == 1
    preflight = (tmp_path / "preflight.txt").read_text()
    assert "preflight ok in " in preflight and "  triton        float32   triton" in preflight
    assert re.search(r"^1 passed, \d+ deselected", (tmp_path / "kernel.txt").read_text(), re.MULTILINE)
    floor = (tmp_path / "floor.txt").read_text()
    assert re.search(r"^ +triton +2 +32 ", floor, re.MULTILINE) and "ratios against gather:" in floor
    serving = (tmp_path / "serving.txt").read_text()
    assert re.search(r"^diptych, triton, CUDA graphs off +\d+ +[\d.]+x +2/2  [\d.]+x$", serving, re.MULTILINE)
    parity = (tmp_path / "parity.txt").read_text()
    assert "transformers generate (float32) equal: split 6/6, colocated 6/6" in parity
    costs = (tmp_path / "costs.txt").read_text()
    assert "to workers in this process (no gateway, no control plane)" in costs  # phase_costs --live workers
    live = [line.split()[:3] for line in costs.splitlines() if line.startswith(("  colocated ", "  split"))]
    assert live == [[mode, "48", "4"] for mode in ("colocated", "split", "split+busy")]
    assert (tmp_path / "phase-costs-diptych-tiny.json").is_file()
    side_by_side = result.stdout[result.stdout.index("== before (gather) and after (triton), side by side") :]
    assert "side by side (eager), ms per decode step" in side_by_side and "diptych, triton," in side_by_side


def test_a_failing_preflight_stops_the_run_before_any_step(tmp_path):
    result = run_script(tmp_path, "--smoke", GPU_CHECK_ATTENTION="flash-varlen")  # no CUDA here: it cannot run
    assert result.returncode == 1
    assert "preflight FAILED" in result.stdout and "the preflight failed: no step runs" in result.stdout
    assert summary_of(result.stdout) == [re.search(r"preflight: rc=1 in \d+ s", result.stdout).group(0)]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpu-check.txt", "hidden", "preflight.txt"]


def test_limits_that_add_up_past_the_budget_refuse_to_start(tmp_path):
    result = run_script(tmp_path, "--smoke", GPU_CHECK_BUDGET="300")
    assert result.returncode == 2
    assert re.search(r"the steps' limits and the setup add up to \d+ s, over the 300 s budget", result.stdout)
    assert not (tmp_path / "preflight.txt").exists()


def test_the_gpu_runs_limits_fit_its_540_s_budget(tmp_path):
    result = run_script(tmp_path, GPU_WHEELS=str(tmp_path / "none"))  # past the budget's check, then no wheels
    assert result.returncode == 2 and "no wheels in " in result.stdout
    assert "over the" not in result.stdout


def kernel_tests(tmp_path: Path, test_source: str, *pytest_args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_kernel.py").write_text(test_source)
    return subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}" && kernel_tests "$@"', "kernel_tests", "test_kernel.py", *pytest_args],
        cwd=tmp_path,
        env={**os.environ, "py": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )


PASSES = "def test_passes():\n    assert True\n"
SKIPS = "import pytest\n\n@pytest.mark.skip(reason='no device')\ndef test_skips():\n    pass\n"


def test_the_kernel_gate_fails_a_run_whose_tests_were_all_or_partly_skipped(tmp_path):
    skipped = kernel_tests(tmp_path, SKIPS)
    assert skipped.returncode == 1 and "kernel tests: 0 passed, 1 skipped" in skipped.stderr
    partly = kernel_tests(tmp_path, PASSES + SKIPS)
    assert partly.returncode == 1 and "kernel tests: 1 passed, 1 skipped" in partly.stderr


def test_the_kernel_gate_passes_passing_tests_and_fails_failing_or_unselected_ones(tmp_path):
    passed = kernel_tests(tmp_path, PASSES)
    assert passed.returncode == 0 and "1 passed" in passed.stdout
    assert kernel_tests(tmp_path, "def test_fails():\n    assert False\n").returncode == 1
    assert kernel_tests(tmp_path, PASSES, "-k", "cuda").returncode == 5  # pytest's own: no test ran
