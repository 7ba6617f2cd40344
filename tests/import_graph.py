"""Python modules' imports as a graph, read from their source: for the tests that hold a package's modules
to one direction (the worker's packages, the control plane's batches app)."""

import ast
from collections import defaultdict
from pathlib import Path


def module_name(path: Path, source_root: Path) -> str:
    """The dotted name of the module at `path`, under a source folder on sys.path (the repository, platform/)."""
    parts = path.relative_to(source_root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, source_root: Path) -> list[tuple[int, str, bool]]:
    """(line, module imported, whether at run time) for every import in the file, those inside functions and
    under TYPE_CHECKING included; `from a import b` counts as a.b when that is a module under
    `source_root`, else as a."""
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
                target = candidate if _is_module(candidate, source_root) else node.module
                found.append((node.lineno, target, node.lineno not in type_only_lines))
    return found


def _is_module(name: str, source_root: Path) -> bool:
    path = source_root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def runtime_import_circles(modules: dict[str, Path], source_root: Path) -> list[list[str]]:
    """The groups of `modules` (name → path) whose imports at run time lead from each to every other."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for _, target, at_run_time in imports(path, source_root):
            if at_run_time and target in modules and target != module:
                edges[module].add(target)
    return circles(edges)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
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
