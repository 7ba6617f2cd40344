"""gRPC stubs regenerated as `make proto` generates them, against the committed ones: a test per set of
stubs checks that `make proto` was run after the last change to their .proto files."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stubs_against_committed(out: Path, include: str, protos: list[str], committed_root: Path) -> dict[str, bool]:
    """Runs protoc on `protos` (paths under the repository) with the import mapping `include` (the Makefile's
    -I), writing into `out`; returns each generated file's path under `out` and whether the file at that
    path under `committed_root` is the same, byte for byte."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    generated = sorted(path.relative_to(out) for path in out.rglob("*") if path.is_file())
    return {str(path): _same_bytes(out / path, committed_root / path) for path in generated}


def _same_bytes(generated: Path, committed: Path) -> bool:
    return committed.is_file() and committed.read_bytes() == generated.read_bytes()
