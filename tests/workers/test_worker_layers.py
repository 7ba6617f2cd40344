"""The worker's packages depend one way: models ← runner ← the engine's parts ← serving ← the processes' mains.

Every module under workers/ is parsed, imports inside functions and under TYPE_CHECKING included. The
model code (`models`) knows nothing of runners; the runner (`runner`) nothing of engines or services; the
engine with its KV connectors, speculative decoding and the KV tier's client side never reach the gRPC
service (`serving`); only a process's entry point (`workers.main`, the KV tier's own server) wires it all,
and nothing imports an entry point. No worker module imports the gateway, the control plane, the planner,
the process launcher or the benchmarks, and the modules' runtime imports form no circle.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "workers"
ENTRY_POINTS = {"workers.main", "workers.kv_tier.server"}
ENGINE_PARTS = frozenset({"engine", "kv_connector", "spec_decode"})
ALLOWED: dict[str, frozenset[str]] = {  # group → the groups its modules may import (their own included)
    "models": frozenset({"models"}),
    "runner": frozenset({"runner", "models"}),
    "structured": frozenset({"structured"}),
    "kv_tier": frozenset({"kv_tier", "runner"}),
    **{part: ENGINE_PARTS | {"runner", "models", "structured", "kv_tier"} for part in ENGINE_PARTS},
    "serving": ENGINE_PARTS | {"serving", "runner", "models", "structured", "kv_tier"},
}
OTHER_FIRST_PARTY = {"gateway", "controlplane", "planner", "diptych_server", "bench", "tests", "diptych"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module imported, whether at run time) for every import in the file; `from a import b` counts
    as a.b when that is a module of the tree, else as a."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                type_only_lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, node.lineno not in type_only_lines) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                target = candidate if _is_module(candidate) else node.module
                found.append((node.lineno, target, node.lineno not in type_only_lines))
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _group(module: str) -> str | None:
    """The package of workers/ a module belongs to (None: the workers package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] != "main") else None


def _worker_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in WORKERS.rglob("*.py")}


def test_each_package_imports_only_the_ones_below_it():
    wrong = []
    for module, path in _worker_modules().items():
        if module in ENTRY_POINTS or _group(module) is None:
            continue
        allowed = ALLOWED[_group(module)]
        for line, target, _ in _imports(path):
            if target.startswith("workers.") and target not in ENTRY_POINTS and _group(target) not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_nothing_imports_an_entry_point_and_no_worker_module_reaches_outside_its_process():
    wrong = []
    for module, path in _worker_modules().items():
        for line, target, _ in _imports(path):
            if target in ENTRY_POINTS and target != module:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the entry point {target}")
            if target.split(".")[0] in OTHER_FIRST_PARTY:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}, outside the worker")
    assert not wrong, "\n".join(wrong)


def test_the_modules_runtime_imports_form_no_circle():
    modules = _worker_modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for _, target, at_run_time in _imports(path):
            if at_run_time and target in modules and target != module:
                edges[module].add(target)
    circles = _circles(edges)
    assert not circles, "modules that import each other: " + "; ".join(" -> ".join(c) for c in circles)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_parser_finds_the_imports_the_rules_judge():
    """The checks above are not vacuous: the parser finds the imports they judge."""
    runner = _imports(WORKERS / "runner" / "model_runner.py")
    assert any(target == "workers.models.attention" for _, target, _ in runner)
    sampling = _imports(WORKERS / "engine" / "sampling.py")
    assert any(target == "workers.models.device_values" for _, target, _ in sampling)
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
