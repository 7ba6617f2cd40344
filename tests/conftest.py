"""Hooks for the whole suite."""

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.skip_summary import pytest_terminal_summary
from workers.models import paged_cpu

__all__ = ["pytest_terminal_summary"]

if not torch.cuda.is_available():
    # The triton attention backend's kernels run on the CPU under Triton's interpreter, which triton reads as
    # each kernel is defined: before any test imports workers.models.triton_attention (or triton).
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET could be set"
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session) -> None:
    """Builds the paged-cpu attention operator (once per machine), so that no worker a test starts waits on it."""
    paged_cpu.unavailable_reason(torch.device("cpu"), torch.float32)


TESTS = Path(__file__).parent
# Tiers by what a test needs (pyproject.toml's markers): `make test-fast` leaves these out.
IMAGE_TESTS = {TESTS / "infra" / "test_image_build.py"}
BROWSER_FIXTURES = {"browser", "page"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(TESTS / "e2e"):
            item.add_marker(pytest.mark.e2e)
        if BROWSER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.browser)
        if path in IMAGE_TESTS:
            item.add_marker(pytest.mark.image)
