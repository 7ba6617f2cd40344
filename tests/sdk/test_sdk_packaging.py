from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sdk_scripted_server import tokens

import diptych

# grpc/__init__.py itself imports grpc_tools, grpc_health and grpc_reflection when they are installed.
ALLOWED_THIRD_PARTY = {"diptych", "grpc", "google", "typing_extensions", "cython_runtime"} | {
    "grpc_tools",
    "grpc_health",
    "grpc_reflection",
}
FORBIDDEN = {"torch", "django", "transformers", "httpx", "requests", "numpy", "diptych_common", "diptych_server"}


def test_sdk_imports_only_grpc_protobuf_and_the_standard_library():
    script = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import diptych\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    imported = {name.split(".")[0] for name in json.loads(result.stdout)}
    third_party = {
        name
        for name in imported - set(sys.stdlib_module_names) - set(sys.builtin_module_names)
        if not name.startswith("_cython")
    }
    assert not imported & FORBIDDEN
    assert third_party <= ALLOWED_THIRD_PARTY, third_party - ALLOWED_THIRD_PARTY


def test_public_surface():
    assert diptych.__version__ == "0.2.0"
    for name in diptych.__all__:
        assert hasattr(diptych, name), name
    from diptych._proto.v1 import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "diptych.v1"
    assert hasattr(inference_pb2_grpc, "InferenceServicer")


# The wheel, built and installed the way a user would, in a virtual environment that holds nothing
# but it and its declared dependencies (linked from this environment, as no index is reachable here).

SDK_DIR = Path(__file__).resolve().parents[2] / "sdk"
DEPENDENCIES = ("grpcio", "protobuf", "typing_extensions")  # typing_extensions: a dependency of grpcio


def _link_distribution(name: str, site_packages: Path) -> None:
    distribution = importlib.metadata.distribution(name)
    top_level = {Path(str(file)).parts[0] for file in distribution.files or () if not str(file).startswith("..")}
    for entry in top_level:
        source = Path(distribution.locate_file(entry))
        if source.exists():
            (site_packages / entry).symlink_to(source)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("sdk-build")
    source = workdir / "sdk"
    shutil.copytree(SDK_DIR, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(workdir / "dist"), str(source)],
        check=True, capture_output=True,
    )
    (built,) = (workdir / "dist").glob("diptych-*.whl")
    return built


def test_wheel_contents_and_declared_dependencies(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"diptych-{diptych.__version__}.dist-info/METADATA").decode()
    assert {"diptych/__init__.py", "diptych/py.typed", "diptych/_proto/v1/inference_pb2.py", "diptych/_proto/v1/inference_pb2.pyi"} <= names
    assert all(name.startswith(("diptych/", "diptych-")) for name in names), names
    requirements = sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:"))
    assert requirements == ["grpcio<2,>=1.85", "protobuf<8,>=7.35"]
    assert "# diptych" in metadata  # the README is the long description


def test_wheel_works_in_a_clean_virtual_environment(wheel, tmp_path, server):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True)
    for name in DEPENDENCIES:
        _link_distribution(name, site_packages)

    subprocess.run([*pip, "check"], check=True, capture_output=True)
    installed = {item["name"].lower().replace("-", "_") for item in json.loads(subprocess.check_output([*pip, "list", "--format=json"]))}
    assert installed == {"diptych", *DEPENDENCIES}

    server.servicer.script = [tokens(("Hi", [1]))]
    script = (
        "import importlib.util, diptych\n"
        "assert not any(importlib.util.find_spec(m) for m in ('torch', 'django', 'transformers', 'httpx'))\n"
        f"with diptych.Client(api_key='k', base_url={server.base_url!r}) as client:\n"
        "    print(client.completions.create(model='m', prompt='x').text, diptych.__file__)\n"
    )
    text, location = subprocess.check_output([python, "-c", script], text=True, cwd=tmp_path).split()
    assert text == "Hi" and Path(location).is_relative_to(site_packages)
