"""A worker killed while torch built or checked the paged-cpu operator leaves torch's lock file behind;
the next worker of the machine loads the operator all the same, instead of waiting for that lock for ever
(which held every later worker, and CI, at start)."""

import os
import shutil
import subprocess
import sys

import torch

from workers.models import paged_cpu

LOADS = (
    "import torch; from workers.models.paged_cpu import unavailable_reason; "
    "print(unavailable_reason(torch.device('cpu'), torch.float32))"
)


def test_a_lock_left_by_a_killed_build_holds_no_later_worker(tmp_path):
    assert paged_cpu.unavailable_reason(torch.device("cpu"), torch.float32) is None  # built, or found built
    built = paged_cpu.built_library().parent
    cache = tmp_path / "extensions"
    shutil.copytree(built, cache / built.name, ignore=shutil.ignore_patterns("lock", "*.flock"))
    (cache / built.name / "lock").touch()  # what a build's process killed with SIGKILL leaves
    loaded = subprocess.run(
        [sys.executable, "-c", LOADS],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "None", loaded.stdout + loaded.stderr
