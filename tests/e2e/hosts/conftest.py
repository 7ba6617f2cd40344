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
