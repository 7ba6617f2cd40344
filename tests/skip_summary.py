"""A pytest plugin (loaded by tests/conftest.py): at the end of a run, the tests skipped because this machine
lacks a tool, grouped by what they need, each group with the command that installs it. A test skipped for a
missing tool says so in its reason as "needs WHAT: COMMAND", e.g.
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")
"""

import re
from collections import defaultdict

import pytest

MISSING_TOOL = re.compile(r"needs (?P<what>[^:]+): (?P<install>\S.*)")
TITLE = "skipped for a missing tool"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def missing_tool_groups(reports) -> dict[tuple[str, str], list[str]]:
    """(what is missing, the command that installs it) -> the ids of the tests skipped for it."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for report in reports:
        match = MISSING_TOOL.fullmatch(_reason(report).strip())
        if match:
            groups[(match["what"], match["install"])].append(report.nodeid)
    return dict(groups)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Around pytest's own summary (the outermost wrapper), so that this section comes last, after the short
    test summary."""
    yield
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    groups = missing_tool_groups(skipped)
    if not groups:
        return
    terminalreporter.section(TITLE, sep="=", yellow=True, bold=True)
    for (what, install), tests in sorted(groups.items(), key=lambda item: -len(item[1])):
        files = sorted({test.split("::")[0] for test in tests})
        count = f"{len(tests)} test{'s' if len(tests) != 1 else ''}"
        terminalreporter.line(f"{count} skipped: needs {what}; install it with: {install}", yellow=True)
        terminalreporter.line(f"    in {', '.join(files)}")
