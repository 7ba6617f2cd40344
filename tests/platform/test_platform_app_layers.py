"""The control plane's apps depend one way: common ← tenancy ← catalog ← metering ← billing ← webhooks ←
batches ← responses, with `internal` (every endpoint the gateway and the workers call) on top of them all.

Every module under platform/controlplane is parsed, imports inside functions included, and so are the
dotted strings that load code by name (`include("controlplane.x.urls")`, settings) and the migrations'
dependencies. A domain app may use only the apps below it; nothing but `internal` itself and the
project's urls and settings may name `internal`.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

CONTROLPLANE = Path(__file__).resolve().parents[2] / "platform" / "controlplane"
# Each may use the ones before it. `idempotency` uses `metering` only as the app whose table its first
# migration took over.
LAYERS = ["common", "tenancy", "catalog", "metering", "idempotency", "billing", "webhooks", "batches", "responses"]
ALLOWED = {app: frozenset(LAYERS[:index]) for index, app in enumerate(LAYERS)}
ALLOWED["dashboard"] = frozenset({"common"})
ALLOWED["internal"] = frozenset(LAYERS)
PROJECT = "project"  # the modules at the top of controlplane/: settings, urls, celery, wsgi, asgi
PROJECT_MODULES_NAMING_INTERNAL = {"urls", "settings"}
DOTTED_NAME = re.compile(r"controlplane\.(\w+)(\.\w+)*(:\w+)?")
INTERNAL_ROUTES = {  # what diptych_common/internal_api/endpoints.py names, and the file URLs manifests give
    "api/v1/internal/api-keys/verify",
    "api/v1/internal/registry",
    "api/v1/internal/worker-credential",
    "api/v1/internal/usage-events",
    "api/v1/internal/rate-limit-refusals",
    "api/v1/internal/idempotency-keys/claim",
    "api/v1/internal/idempotency-keys/complete",
    "api/v1/internal/idempotency-keys/release",
    "api/v1/internal/webhooks/events",  # the gateway's response events (no caller yet)
    "api/v1/internal/responses",  # the gateway's stored responses (/v1/responses)
    "api/v1/internal/responses/<str:response_id>",
    "api/v1/internal/responses/<str:response_id>/status",
    "api/v1/internal/responses/<str:response_id>/cancel",
    "api/v1/internal/responses/<str:response_id>/input-items",
    "api/v1/internal/workers/register",
    "api/v1/internal/workers/<str:worker_id>/heartbeat",
    "api/v1/internal/artifacts/manifest",  # diptych_common/artifacts.py (workers), with the fleet token
    "api/v1/internal/artifacts/files/<str:model>/<str:revision>/<path:path>",
    "api/v1/internal/artifacts/models/<str:model>/manifest",  # the gateway, for a published model's tokenizer
    "api/v1/internal/artifacts/models/<str:model>/files/<str:revision>/<path:path>",
    "api/v1/internal/models/register",  # `diptych model register`, with the internal token
}


@dataclass(frozen=True)
class Reference:
    path: str
    line: int
    target: str  # the app referred to

    def __str__(self) -> str:
        return f"{self.path}:{self.line} uses controlplane.{self.target}"


def _module_parts(path: Path) -> list[str]:
    parts = ["controlplane", *path.relative_to(CONTROLPLANE).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _absolute(node: ast.ImportFrom, parts: list[str], is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    package = parts if is_package else parts[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets_of_import(node: ast.AST, parts: list[str], is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        module = _absolute(node, parts, is_package)
        return [f"{module}.{alias.name}" for alias in node.names]  # `from controlplane import billing`
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_NAME.fullmatch(node.value):
        return [node.value]
    return []


def _migration_dependencies(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, app label) of each `dependencies = [("label", "0001_..."), ...]` entry."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "dependencies" for t in node.targets):
            for entry in ast.walk(node.value):
                if isinstance(entry, ast.Tuple) and entry.elts and isinstance(entry.elts[0], ast.Constant):
                    found.append((entry.lineno, entry.elts[0].value))
    return found


def references(source: str, path: Path) -> list[Reference]:
    """Every app of controlplane that the module at `path` names, by import or by dotted string."""
    tree = ast.parse(source, filename=str(path))
    parts, shown = _module_parts(path), str(path.relative_to(CONTROLPLANE))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        apps = {
            names[1]
            for names in (target.split(".") for target in _targets_of_import(node, parts, is_package))
            if names[0] == "controlplane" and len(names) > 1 and (CONTROLPLANE / names[1]).is_dir()
        }
        found += [Reference(shown, node.lineno, app) for app in sorted(apps)]
    if "migrations" in parts:
        found += [Reference(shown, line, label) for line, label in _migration_dependencies(tree) if label in ALLOWED]
    return found


def app_of(path: Path) -> str:
    relative = path.relative_to(CONTROLPLANE)
    return relative.parts[0] if len(relative.parts) > 1 else PROJECT


def every_module() -> list[Path]:
    return sorted(CONTROLPLANE.rglob("*.py"))


def layering_violations(modules: dict[Path, str]) -> list[str]:
    violations = []
    for path, source in modules.items():
        app = app_of(path)
        for reference in references(source, path):
            if reference.target == app:
                continue
            if reference.target == "internal":
                if app == PROJECT and path.stem in PROJECT_MODULES_NAMING_INTERNAL:
                    continue
                violations.append(f"{reference}: only the project's urls and settings may name internal")
            elif app != PROJECT and reference.target not in ALLOWED[app]:
                allowed = f"only {', '.join(sorted(ALLOWED[app]))}" if ALLOWED[app] else "no other app"
                violations.append(f"{reference}: {app} may use {allowed}")
    return violations


def test_every_app_has_a_place_in_the_layers():
    apps = {path.name for path in CONTROLPLANE.iterdir() if (path / "__init__.py").is_file()}
    assert apps == set(ALLOWED), f"place each app in LAYERS (or ALLOWED): {sorted(apps ^ set(ALLOWED))}"


def test_apps_depend_one_way_only():
    modules = {path: path.read_text() for path in every_module()}
    violations = layering_violations(modules)
    assert not violations, "\n".join(["upward or internal references:", *violations])


def test_the_scan_sees_the_edges_the_control_plane_has():
    """The scan is not vacuous: it finds known downward edges, by import and by migration dependency."""
    seen = {(app_of(path), ref.target) for path in every_module() for ref in references(path.read_text(), path)}
    assert {("billing", "metering"), ("metering", "tenancy"), ("internal", "billing"), (PROJECT, "internal")} <= seen
    migration = CONTROLPLANE / "billing" / "migrations" / "0001_initial.py"
    assert "tenancy" in {ref.target for ref in references(migration.read_text(), migration)}


UPWARD_IN_A_FUNCTION = """
def spend(organization):
    from ..billing.selectors import spend_status
    return spend_status(organization=organization)
"""


@pytest.mark.parametrize(
    ("source", "where", "message"),
    [
        (UPWARD_IN_A_FUNCTION, "tenancy/apis.py", "tenancy/apis.py:3 uses controlplane.billing: tenancy may use only"),
        ("import controlplane.billing.periods\n", "metering/services.py", "metering may use only"),
        ("from controlplane import catalog\n", "common/errors.py", "common may use no other app"),
        ('urlpatterns = [include("controlplane.internal.urls")]\n', "catalog/urls.py", "may name internal"),
        ("from controlplane.internal.apis import RegistryApi\n", "celery.py", "may name internal"),
        ("dependencies = [('billing', '0001_initial')]\n", "metering/migrations/0004_x.py", "metering may use"),
    ],
)
def test_an_upward_or_internal_reference_is_reported(source, where, message):
    (violation,) = layering_violations({CONTROLPLANE / where: source})
    assert message in violation


def _routes(patterns, prefix: str = ""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern), pattern.callback.__module__


def test_the_internal_app_serves_exactly_the_internal_prefix():
    routes = list(_routes(get_resolver().url_patterns))
    internal = {route for route, module in routes if module.startswith("controlplane.internal.")}
    prefixed = {route for route, _ in routes if route.startswith("api/v1/internal/")}
    assert internal == prefixed == INTERNAL_ROUTES
