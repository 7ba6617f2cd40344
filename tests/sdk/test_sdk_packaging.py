from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sdk_scripted_server import tokens

import diptych
from tests.proto_stubs import stubs_against_committed

# grpc/__init__.py itself imports grpc_tools, grpc_health and grpc_reflection when they are installed.
ALLOWED_THIRD_PARTY = {"diptych", "diptych_proto", "grpc", "google", "typing_extensions", "cython_runtime"} | {
    "grpc_tools",
    "grpc_health",
    "grpc_reflection",
}
SERVER_PACKAGES = ("gateway", "workers", "diptych_server", "diptych_common", "controlplane")
FORBIDDEN = {"torch", "django", "transformers", "httpx", "requests", "numpy", *SERVER_PACKAGES}
REPO = Path(__file__).resolve().parents[2]


def test_sdk_imports_only_grpc_protobuf_the_contract_and_the_standard_library():
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
    from diptych_proto.v1 import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "diptych.v1"
    assert hasattr(inference_pb2_grpc, "InferenceServicer")
    assert importlib.util.find_spec("diptych._proto") is None  # the stubs live once, in the contract package


# The boundary between the SDK and the server: they share the contract package, never the SDK's insides,
# so that the SDK may change its private modules in any release.


def private_sdk_imports(path: Path) -> list[str]:
    """`import diptych._x`, `from diptych._x[.y] import ...` and `from diptych import _x` in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {name}" for name in names if _is_private_to_the_sdk(name)]
    return found


def _is_private_to_the_sdk(module: str) -> bool:
    top, *parts = module.split(".")
    return top == "diptych" and any(part.startswith("_") and not part.startswith("__") for part in parts)


def test_no_server_code_imports_the_sdk_s_private_modules():
    folders = ("gateway", "workers", "diptych_server", "diptych_common", "bench", "platform")
    sources = [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]
    assert len(sources) > 50
    assert [hit for path in sources for hit in private_sdk_imports(path)] == []


def test_the_private_import_check_finds_every_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import diptych._convert\n"
        "from diptych.resources._generate import generate\n"
        "from diptych import _retry, Client, __version__\n"
        "import diptych, diptych.types\n"
        "from diptych_proto.v1 import inference_pb2\n"
    )
    assert private_sdk_imports(probe) == [
        "probe.py:1 diptych._convert",
        "probe.py:2 diptych.resources._generate",
        "probe.py:2 diptych.resources._generate.generate",
        "probe.py:3 diptych._retry",
    ]


def imported_modules(path: Path, package: str) -> set[str]:
    """The absolute names of the modules (and of the names from them) that a module of `package` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_the_resources_do_not_import_the_client():
    """The client imports the resources; they see it only through the protocols of resources/_connections.py."""
    resources = sorted((REPO / "sdk/src/diptych/resources").glob("*.py"))
    imports = {path.name: imported_modules(path, "diptych.resources") for path in resources}
    assert "diptych._http.AdminTransport" in imports["_connections.py"]
    client_imports = [
        f"{name}: {module}"
        for name, modules in imports.items()
        for module in modules
        if module.startswith("diptych._client")
    ]
    assert client_imports == []


# The wheels, built and installed the way a user would, in a virtual environment that holds nothing but
# them and their declared dependencies (linked from this environment, as no index is reachable here): the
# SDK and the contract package it depends on.

DISTRIBUTIONS = {"diptych": REPO / "sdk", "diptych_proto": REPO / "proto"}
DEPENDENCIES = ("grpcio", "protobuf", "typing_extensions")  # typing_extensions: a dependency of grpcio


def _link_distribution(name: str, site_packages: Path) -> None:
    distribution = importlib.metadata.distribution(name)
    top_level = {Path(str(file)).parts[0] for file in distribution.files or () if not str(file).startswith("..")}
    for entry in top_level:
        source = Path(distribution.locate_file(entry))
        if source.exists():
            (site_packages / entry).symlink_to(source)


def _metadata(wheel: Path) -> tuple[set[str], str]:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        return names, archive.read(metadata).decode()


def _requirements(metadata: str) -> list[str]:
    return sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:"))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    workdir = tmp_path_factory.mktemp("sdk-build")
    built = {}
    for name, folder in DISTRIBUTIONS.items():
        source = workdir / folder.name
        shutil.copytree(folder, source, ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__"))
        subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(workdir / name), str(source)],
            check=True,
            capture_output=True,
        )
        (built[name],) = (workdir / name).glob("*.whl")
    return built


def test_sdk_wheel_contents_and_declared_dependencies(wheels):
    names, metadata = _metadata(wheels["diptych"])
    assert {"diptych/__init__.py", "diptych/py.typed", "diptych/_transport.py"} <= names
    assert all(name.startswith(("diptych/", f"diptych-{diptych.__version__}.dist-info/")) for name in names), names
    assert not any("_pb2" in name for name in names), names
    assert _requirements(metadata) == ["diptych-proto<2,>=1.0", "grpcio<2,>=1.85", "protobuf<8,>=7.35"]
    assert "# diptych" in metadata  # the README is the long description


def test_contract_wheel_holds_the_stubs_and_nothing_else(wheels):
    names, metadata = _metadata(wheels["diptych_proto"])
    version = importlib.metadata.version("diptych-proto")
    assert {
        "diptych_proto/__init__.py",
        "diptych_proto/py.typed",
        "diptych_proto/v1/__init__.py",
        "diptych_proto/v1/inference_pb2.py",
        "diptych_proto/v1/inference_pb2.pyi",
        "diptych_proto/v1/inference_pb2_grpc.py",
    } <= names
    assert all(name.startswith(("diptych_proto/", f"diptych_proto-{version}.dist-info/")) for name in names), names
    assert not any("worker" in name for name in names), names  # the internal contract stays internal
    assert _requirements(metadata) == ["grpcio<2,>=1.85.1", "protobuf<8,>=7.35.1"]


def test_the_contract_stubs_are_generated_from_inference_proto(tmp_path):
    """`make proto` was run after the last change to inference.proto: the stubs match it byte for byte."""
    stubs = stubs_against_committed(
        tmp_path, "diptych_proto/v1=proto/diptych/v1", ["proto/diptych/v1/inference.proto"], REPO / "proto" / "src"
    )
    names = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")
    assert stubs == {f"diptych_proto/v1/{name}": True for name in names}, "stale stubs: run make proto"


def test_wheels_work_in_a_clean_virtual_environment_without_the_server(wheels, tmp_path, server):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site_packages = Path(subprocess.check_output([python, "-c", purelib], text=True).strip())
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--no-index", *map(str, wheels.values())], check=True)
    for name in DEPENDENCIES:
        _link_distribution(name, site_packages)

    subprocess.run([*pip, "check"], check=True, capture_output=True)
    listed = json.loads(subprocess.check_output([*pip, "list", "--format=json"]))
    installed = {item["name"].lower().replace("-", "_") for item in listed}
    assert installed == {"diptych", "diptych_proto", *DEPENDENCIES}

    server.servicer.script = [tokens(("Hi", [1]))]
    absent = ("torch", "django", "transformers", "httpx", *SERVER_PACKAGES)
    script = (
        "import importlib.util, diptych, diptych_proto\n"
        f"assert not [m for m in {absent!r} if importlib.util.find_spec(m)]\n"
        f"with diptych.Client(api_key='k', base_url={server.base_url!r}) as client:\n"
        "    print(client.completions.create(model='m', prompt='x').text, diptych.__file__, diptych_proto.__file__)\n"
    )
    text, *locations = subprocess.check_output([python, "-c", script], text=True, cwd=tmp_path).split()
    assert text == "Hi" and all(Path(location).is_relative_to(site_packages) for location in locations)


def test_the_sdk_is_clean_under_mypy_strict():
    """The package ships py.typed: its own code must type-check strictly, or users' strict checks inherit Any."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "sdk/src/diptych"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
