"""Hooks for the whole suite."""

import os
import sys

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
