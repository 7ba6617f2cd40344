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
# Modules outside tests/e2e that took 10 s or more in a whole run (make test's .diptych/test-times.xml): they
# start the platform's processes, fuzz an API or search plans.
SLOW_MODULES = {
    TESTS / name
    for name in (
        "bench/test_bench_smoke.py",
        "bench/test_chaos_smoke.py",
        "bench/test_gpu_check.py",
        "bench/test_phase_costs.py",
        "bench/test_plan_validation.py",
        "gateway/test_batch_proxy.py",
        "infra/test_chart_jobs_probes.py",
        "planner/test_analytic.py",
        "planner/test_search.py",
        "platform/test_platform_batch_input_fuzz.py",
        "platform/test_platform_gateway_idempotency.py",
        "platform/test_platform_gateway_idempotency_outage.py",
        "platform/test_platform_isolation_matrix.py",
        "platform/test_platform_schemathesis.py",
        "platform/test_responses_store.py",
        "platform/test_webhooks_delivery.py",
        "test_skip_summary.py",
        "workers/test_step_graphs.py",
        "workers/test_tensor_parallel.py",
        "workers/test_triton_attention.py",
    )
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(TESTS / "e2e"):
            item.add_marker(pytest.mark.e2e)
        if BROWSER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.browser)
        if path in IMAGE_TESTS:
            item.add_marker(pytest.mark.image)
        if path in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
