"""`platform/` is a source folder: it must never shadow the standard library's `platform` module."""

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STDLIB_DIR = Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_platform_folder_is_not_a_package():
    assert not (REPO_ROOT / "platform" / "__init__.py").exists()


def test_import_platform_from_the_repository_root_gives_the_standard_library():
    completed = subprocess.run(
        [sys.executable, "-c", "import platform, sys; print(platform.__file__); print(platform.python_version())"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    module_file, version = completed.stdout.splitlines()
    assert Path(module_file).resolve().parent == STDLIB_DIR
    assert version == sysconfig.get_python_version() + "." + version.split(".")[2]
    assert version == ".".join(map(str, sys.version_info[:3]))


def test_import_platform_in_the_test_process_gives_the_standard_library():
    import platform

    import controlplane

    assert Path(platform.__file__).resolve().parent == STDLIB_DIR
    assert Path(controlplane.__file__).resolve().parent == REPO_ROOT / "platform" / "controlplane"
