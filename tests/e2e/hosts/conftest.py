"""The platform across hosts made of network namespaces (bench.hosts). A test that needs namespaces asks
for the `namespaces` fixture, and skips with the reason where they cannot be made (not root, no `ip`)."""

import pytest

from bench.hosts.network import harness_links, harness_namespaces, why_namespaces_cannot_be_made


@pytest.fixture(scope="session")
def namespaces() -> None:
    if reason := why_namespaces_cannot_be_made():
        pytest.skip(f"network namespaces: {reason}")


def assert_nothing_left() -> None:
    left = harness_namespaces() + harness_links()
    assert not left, f"the harness left namespaces or links behind: {left}"


LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the hosts' platform shows the end of each of its processes' logs: what a gateway or
    worker inside a namespace saw is otherwise lost with the run's state directory."""
    outcome = yield
    report = outcome.get_result()
    platform = getattr(item, "funcargs", {}).get("hosts")
    if report.when != "call" or not report.failed or platform is None:
        return
    for name in sorted(platform.stack.launches):
        path = platform.stack.log_path(name)
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"the end of {name}'s log", "\n".join(tail)))
