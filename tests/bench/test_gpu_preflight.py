"""`python -m bench.gpu_preflight` on the CPU: the table it prints, and each way it stops the GPU run (a
backend under test that cannot run, a carried wheel not installed at its pin, a module that does not import).
tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA, so triton runs here, interpreted."""

import pytest
import torch

from bench import gpu_preflight
from workers.models.backends import ATTENTION_BACKENDS

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's table: this machine has CUDA")


def test_on_the_cpu_it_prints_versions_imports_apis_and_each_backends_choice_and_passes_for_triton(capsys):
    assert gpu_preflight.main(["--device", "cpu", "--attention", "triton"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Python 3.") and f"torch {torch.__version__}" in lines[0] and "triton 3." in lines[0]
    assert lines[1] == "TRITON_INTERPRET='1'"
    modules = len(gpu_preflight.STEP_MODULES)
    assert any(line.startswith(f"imported the steps' modules: {modules} of {modules} (") for line in lines)
    carried = [line for line in lines if line.startswith("  ok      ") and "==" in line.split(":")[0]]
    assert len(carried) == len(gpu_preflight.carried_wheels())
    assert any("scaled_dot_product_attention(enable_gqa=)" in line and line.startswith("  ok") for line in lines)
    table = lines[lines.index("attention on cpu (choose_backend, blocks of 16 tokens; flash-varlen 256):") + 1 :][:-1]
    assert [row.split()[:2] for row in table] == [[backend, "float32"] for backend in ATTENTION_BACKENDS]
    rows = {row.split()[0]: row.split(maxsplit=2)[2] for row in table}
    assert rows["gather"] == "gather" and rows["triton"] == "triton"
    assert rows["auto"] != "triton"  # auto never takes the interpreted kernel
    assert rows["flash-varlen"].startswith("cannot run: FlashAttention varlen runs on CUDA devices only")
    assert lines[-1].startswith("preflight ok in ") and lines[-1].endswith(
        "triton, the backend under test, runs on cpu"
    )


def test_a_backend_under_test_that_cannot_run_fails_it(capsys):
    assert gpu_preflight.main(["--device", "cpu", "--attention", "flash-varlen"]) == 1
    out = capsys.readouterr().out
    assert "preflight FAILED in " in out
    assert "  - the backend under test, flash-varlen, at float32: cannot run: FlashAttention varlen" in out


def test_a_carried_wheel_not_installed_at_its_pin_fails_it(capsys, monkeypatch):
    monkeypatch.setattr(gpu_preflight, "carried_wheels", lambda: {"transformers": "0.0.1", "no-such-wheel": "1.0"})
    assert gpu_preflight.main(["--device", "cpu", "--attention", "gather"]) == 1
    out = capsys.readouterr().out
    assert "  MISSING transformers==0.0.1: " in out and "  MISSING no-such-wheel==1.0: not installed" in out
    assert "  - carried transformers==0.0.1: " in out


def test_a_module_of_the_steps_that_does_not_import_fails_it(capsys, monkeypatch):
    monkeypatch.setattr(gpu_preflight, "STEP_MODULES", (*gpu_preflight.STEP_MODULES, "bench.no_such_step"))
    assert gpu_preflight.main(["--device", "cpu", "--attention", "gather"]) == 1
    out = capsys.readouterr().out
    assert "  - import bench.no_such_step: ModuleNotFoundError: No module named 'bench.no_such_step'" in out


def test_on_a_machine_without_cuda_the_gpu_run_fails_it(capsys):
    assert gpu_preflight.main(["--device", "cuda", "--attention", "gather"]) == 1
    assert "  - --device cuda: this torch" in capsys.readouterr().out
