"""The first-party import graph the layering tests judge: every import of a module, inside functions and
under TYPE_CHECKING included, and the circles among modules."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules_under(package: Path, source_root: Path = ROOT) -> dict[str, Path]:
    """The dotted name of every module in the package, its subpackages included; `source_root` is the folder
    its names start from (the repository, or platform/ for the control plane's `controlplane`)."""
    return {module_name(path, source_root): path for path in package.rglob("*.py")}


def module_name(path: Path, source_root: Path = ROOT) -> str:
    parts = path.relative_to(source_root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, source_root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module imported) for every import in the file, those for type checking alone included;
    `from a import b` counts as a.b when that is a module of the tree, else as a."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.append((node.lineno, candidate if is_module(candidate, source_root) else node.module))
    return found


def is_module(name: str, source_root: Path = ROOT) -> bool:
    path = source_root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_circles(modules: dict[str, Path], source_root: Path = ROOT) -> list[list[str]]:
    """The circles among `modules` (dotted name → file) that their imports make."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges[module] = {target for _, target in imports(path, source_root) if target in modules and target != module}
    return circles(edges)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    search = _Components(edges)
    for node in sorted(edges):
        if node not in search.index:
            search.visit(node)
    return search.found


class _Components:
    def __init__(self, edges: dict[str, set[str]]) -> None:
        self.edges = edges
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        self.found: list[list[str]] = []

    def visit(self, node: str) -> None:
        index, low = self.index, self.low
        index[node] = low[node] = len(index)
        self.stack.append(node)
        self.on_stack.add(node)
        for successor in sorted(self.edges.get(node, ())):
            if successor not in index:
                self.visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in self.on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = self._pop_through(node)
            if len(component) > 1:
                self.found.append(sorted(component))

    def _pop_through(self, node: str) -> list[str]:
        component = []
        while True:
            member = self.stack.pop()
            self.on_stack.discard(member)
            component.append(member)
            if member == node:
                return component
