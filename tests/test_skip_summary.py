"""A run that skips tests because this machine lacks a tool (Chromium, docker compose) ends by saying which, with
the command that installs it (tests/skip_summary.py), instead of leaving them among the other skips."""

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.skip_summary import MISSING_TOOL, TITLE

REPO = Path(__file__).resolve().parents[1]
# What the tests below check for before they skip: Debian's chromium, docker compose.
TOOL_CHECKS = ("CHROMIUM", "_compose_binary")


def _tool_skip_reasons() -> list[tuple[str, str]]:
    """The reason of every skipif in the suite whose condition checks for a tool, with its file."""
    reasons = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("mark.skipif") and node.args:
                condition = ast.unparse(node.args[0])
                if any(check in condition for check in TOOL_CHECKS):
                    (reason,) = [k.value for k in node.keywords if k.arg == "reason"]
                    assert isinstance(reason, ast.Constant), f"{path}: {condition}: a reason the summary can read"
                    reasons.append((reason.value, path.relative_to(REPO).as_posix()))
    return reasons


def test_every_skip_for_a_missing_tool_names_it_and_the_command_that_installs_it():
    reasons = _tool_skip_reasons()
    assert {path for _, path in reasons} >= {
        "tests/e2e/test_dashboard.py",
        "tests/e2e/test_dashboard_costs.py",
        "tests/e2e/test_dashboard_limits.py",
        "tests/e2e/test_batch_api.py",
        "tests/infra/test_compose.py",
    }
    for reason, path in reasons:
        assert MISSING_TOOL.fullmatch(reason), f"{path}: {reason!r} is not 'needs WHAT: COMMAND'"


def _run(tmp_path: Path, tests: str) -> str:
    """Runs pytest on `tests` in a directory of its own with the suite's tests/conftest.py as its one plugin."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_tools.py").write_text(tests)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-ra", "test_tools.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_run_that_skips_for_missing_tools_ends_with_each_tool_and_its_install_command(tmp_path):
    reasons = sorted({reason for reason, _ in _tool_skip_reasons()})
    tests = ["import pytest", ""]
    for index, reason in enumerate(reasons):
        for copy in range(2):  # two tests per reason: the summary counts them
            tests += [f"@pytest.mark.skipif(True, reason={reason!r})", f"def test_{index}_{copy}():", "    pass", ""]
    tests += ["def test_redis():", "    pytest.skip('no Redis at redis://127.0.0.1:6379/0')", ""]
    tests += ["def test_runs():", "    pass", ""]
    output = _run(tmp_path, "\n".join(tests))
    assert TITLE in output, output
    assert output.index("short test summary info") < output.index(TITLE)  # last, where it is seen
    summary = output[output.index(TITLE) :]
    for reason in reasons:
        match = MISSING_TOOL.fullmatch(reason)
        assert f"2 tests skipped: needs {match['what']}; install it with: {match['install']}" in summary, summary
    assert "apt-get install -y chromium" in summary and "apt-get install -y docker-compose" in summary
    assert "Redis" not in summary  # not a tool: left among the other skips


def test_a_run_without_such_skips_prints_no_such_section(tmp_path):
    output = _run(tmp_path, "import pytest\n\ndef test_redis():\n    pytest.skip('no Redis at redis://x')\n")
    assert "1 skipped" in output and TITLE not in output
