"""Hooks for the whole suite."""

import torch

from tests.skip_summary import pytest_terminal_summary
from workers.models import paged_cpu

__all__ = ["pytest_terminal_summary"]


def pytest_sessionstart(session) -> None:
    """Builds the paged-cpu attention operator (once per machine), so that no worker a test starts waits on it."""
    paged_cpu.unavailable_reason(torch.device("cpu"), torch.float32)
