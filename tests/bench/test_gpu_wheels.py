"""The GPU machine installs nothing but the wheels bench/gpu_wheels.sh carries. Every third-party package that
a module of the GPU steps imports (`bench.gpu_preflight.STEP_MODULES` and the kernel test's modules, followed
through the repository's import graph) must be carried or in the machine's image
(bench/gpu_image_packages.txt); so must every carried wheel's own needs, at versions that meet them; and no
carried wheel may need torch or triton, whose image builds are the ones everything there runs against."""

import ast
import functools
import importlib.metadata
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

from bench.gpu_preflight import KERNEL_TEST_MODULES, STEP_MODULES, carried_wheels, image_packages, normalized
from tests.import_graph import ROOT

SOURCE_ROOTS = (ROOT, ROOT / "proto" / "src")  # what gpu_check.sh puts on PYTHONPATH
# the GPU machine's interpreter, for the wheels' environment markers
GPU_MACHINE = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
# imports in functions that no GPU step reaches, each with the reason
NOT_ON_THE_GPU_PATH = {
    "boto3": "diptych_common.artifacts: models stored in S3; the GPU steps load built-in models",
    "botocore": "diptych_common.artifacts: the same",
    "nixl_cu13": "workers.kv_connector.nixl: an agent starts only where nixl_unavailable() finds NIXL installed",
}
TORCH_BUILT = ("torch", "triton")


# ---- the import graph ---------------------------------------------------------------------------------------


def module_file(name: str, roots: Iterable[Path]) -> Path | None:
    """The file of a first-party module, under the first source root that holds it; the folder of a
    namespace package (one without __init__.py, such as tests/workers)."""
    for root in roots:
        path = root.joinpath(*name.split("."))
        if (path / "__init__.py").is_file():
            return path / "__init__.py"
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
        if path.is_dir():
            return path
    return None


class RunnableImports(ast.NodeVisitor):
    """The modules a file can import when it runs: at module level and in functions alike, but not those for
    type checking alone, nor those in a `try` that catches ImportError (optional by design)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        if any(_catches_import_error(handler) for handler in node.handlers):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.package.rsplit(".", node.level - 1)[0] if node.level > 1 else self.package
            base = f"{package}.{base}" if base else package
        # `from a import b` imports a.b where b is a module of a, else a alone: the longest prefix that is one
        self.found += [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in caught)


def third_party_imports(roots_modules: Iterable[str], roots: Iterable[Path]) -> dict[str, set[str]]:
    """Every non-standard, non-first-party module the graph from `roots_modules` imports -> the first-party
    modules importing it."""
    roots = tuple(roots)
    seen: set[str] = set()
    found: dict[str, set[str]] = {}
    pending = list(roots_modules)
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(module, roots)
        if path is None:
            raise AssertionError(f"{module}: no such module of the repository")
        if "." in module:
            pending.append(module.rpartition(".")[0])  # importing a module runs its packages' __init__
        if path.is_dir():
            continue  # a namespace package runs no code of its own
        visitor = RunnableImports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        for name in visitor.found:
            top = name.partition(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if module_file(top, roots) is not None:
                pending.append(longest_module(name, roots))
            else:
                found.setdefault(name, set()).add(module)
    return found


def longest_module(name: str, roots: Iterable[Path]) -> str:
    """The longest prefix of a dotted name that is a first-party module (`a.b.f` of a function f is a.b)."""
    while "." in name and module_file(name, roots) is None:
        name = name.rpartition(".")[0]
    return name


@functools.cache
def distribution_files() -> dict[str, str]:
    """Dotted module name -> the installed distribution whose files hold it."""
    found: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():
        name = normalized(distribution.metadata["Name"])
        for file in distribution.files or ():
            if ".." in file.parts or file.suffix not in (".py", ".so"):
                continue
            parts = [*file.parts[:-1], file.name.partition(".")[0]]  # x.cpython-311-x86_64-linux-gnu.so is x
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), name)
    return found


def distribution_of(module: str) -> str | None:
    """The distribution of the longest prefix of `module` that an installed one holds."""
    files = distribution_files()
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (name := files.get(".".join(parts[:end]))) is not None:
            return name
    return None


def needed_distributions(roots_modules: Iterable[str], roots: Iterable[Path]) -> dict[str, set[str]]:
    """distribution -> the first-party modules that import it; a module no installed distribution holds
    fails here, unless NOT_ON_THE_GPU_PATH says why no GPU step imports it."""
    needed: dict[str, set[str]] = {}
    unknown = []
    for module, importers in third_party_imports(roots_modules, roots).items():
        if module.partition(".")[0] in NOT_ON_THE_GPU_PATH:
            continue
        distribution = distribution_of(module)
        if distribution is None:
            unknown.append(f"{module} (imported by {', '.join(sorted(importers))})")
        else:
            needed.setdefault(distribution, set()).update(importers)
    assert not unknown, f"installed here in no distribution, so nobody can say whether the GPU has them: {unknown}"
    return needed


def missing_on_the_gpu(roots_modules: Iterable[str], roots: Iterable[Path] = SOURCE_ROOTS) -> dict[str, list[str]]:
    available = set(carried_wheels()) | set(image_packages())
    needed = needed_distributions(roots_modules, roots)
    # a lazy import that NOT_ON_THE_GPU_PATH names may also be a distribution's name: none of those is needed
    exempt = {normalized(name) for name in NOT_ON_THE_GPU_PATH}
    return {name: sorted(importers) for name, importers in needed.items() if name not in available | exempt}


# ---- the tests ------------------------------------------------------------------------------------------------


def test_every_package_the_gpu_steps_import_is_carried_or_in_the_image():
    roots = (*STEP_MODULES, *KERNEL_TEST_MODULES)
    needed = needed_distributions(roots, SOURCE_ROOTS)
    assert {"torch", "transformers", "grpcio", "protobuf", "llguidance", "opentelemetry-sdk"} <= set(needed)
    assert "django" not in needed  # the GPU machine has no Django: no step may start the control plane
    assert missing_on_the_gpu(roots) == {}


def test_the_check_fails_for_an_import_that_neither_holds_and_not_for_optional_ones(tmp_path):
    package = tmp_path / "gpuprobe"
    package.mkdir()
    (package / "__init__.py").write_text("from gpuprobe import steps\n")
    (package / "steps.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import yaml  # in the image\n"
        "if TYPE_CHECKING:\n"
        "    import django\n"
        "try:\n"
        "    import celery\n"
        "except ImportError:\n"
        "    celery = None\n"
        "def later():\n"
        "    import redis  # in a function: it runs when called\n"
    )
    assert missing_on_the_gpu(["gpuprobe"], [tmp_path]) == {"redis": ["gpuprobe.steps"]}


def needs_on_the_gpu(name: str) -> list[Requirement]:
    """What the installed distribution `name` requires on the GPU machine (no extras)."""
    requirements = map(Requirement, importlib.metadata.requires(name) or ())
    return [r for r in requirements if r.marker is None or r.marker.evaluate(GPU_MACHINE)]


def test_each_carried_wheel_is_the_version_here_and_what_it_needs_is_there_at_a_version_that_serves():
    carried, image = carried_wheels(), image_packages()
    unmet = []
    for name, version in carried.items():
        installed = importlib.metadata.version(name)  # whose metadata speaks for the carried wheel
        assert installed == version, f"{name}: {installed} here, {version} in gpu_wheels.sh"
        for requirement in needs_on_the_gpu(name):
            needed = normalized(requirement.name)
            there = carried.get(needed) or image.get(needed)
            if needed not in carried and needed not in image:
                unmet.append(f"{name} needs {requirement}: neither carried nor in the image")
            elif there is not None and not requirement.specifier.contains(there, prereleases=True):
                unmet.append(f"{name} needs {requirement}: {needed} {there} there")
    assert unmet == []


def test_nothing_carried_is_or_needs_torch_or_triton():
    carried = carried_wheels()
    assert not set(TORCH_BUILT) & set(carried)
    for name in carried:
        needs = {normalized(requirement.name) for requirement in needs_on_the_gpu(name)}
        assert not {need for need in needs if need in TORCH_BUILT or need.startswith("nvidia-")}, name


def test_the_wheel_list_and_the_image_list_parse_to_normalized_names(tmp_path):
    script = tmp_path / "wheels.sh"
    script.write_text("x=1\nwheels=(\n    Foo_Bar==1.2  # why\n    # a comment\n    baz.qux==0.1b2\n)\necho\n")
    assert carried_wheels(script) == {"foo-bar": "1.2", "baz-qux": "0.1b2"}
    listing = tmp_path / "image.txt"
    listing.write_text("# header\ntyping_extensions\nTorch==2.11.0\n")
    assert image_packages(listing) == {"typing-extensions": None, "torch": "2.11.0"}
    assert image_packages()["torch"] == "2.11.0" and "triton" in image_packages()
