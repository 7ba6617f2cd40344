"""The gateway's parts depend one way, from the ground up: its metrics ← what
it knows of the workers (`fleet`) ← its own types ← `routing` (which workers), `autoscale` (how many),
`accounts` (who asks, their limits, keys and usage) and `planning` (a request checked into a plan) ← the
request `core` (the pipeline, the run on workers, delivery) ← the fronts (`anthropic_api`, `openai_api`,
`grpc_api`) ← the process (`gateway.main`). The HTTP server (`openai_api.app`) mounts the Messages API's
routes beside OpenAI's; the Messages API imports nothing of OpenAI's front (both read bodies through
`gateway.bodies`, at the ground).

Every module under gateway/ is parsed, imports inside functions and under TYPE_CHECKING included. The fronts
do not import each other (but for that mount), nothing imports the entry point, no gateway module imports
the workers, the control plane, the planner, the launcher, the SDK, the benchmarks or the tests, and the
modules' imports (those for type checking too) form no circle.
"""

from tests.import_graph import ROOT, import_circles, imports, modules_under

GATEWAY = ROOT / "gateway"
ENTRY_POINT = "gateway.main"
GROUND = frozenset({"metrics", "bodies"})
BELOW_TYPES = GROUND | {"fleet"}
MIDDLE = BELOW_TYPES | {"types"}
BELOW_CORE = MIDDLE | {"routing", "autoscale", "accounts", "planning"}
ALLOWED: dict[str, frozenset[str]] = {  # part → the parts its modules may import (their own included)
    "metrics": frozenset({"metrics"}),
    "bodies": frozenset({"bodies"}),
    "fleet": BELOW_TYPES,
    "types": MIDDLE,
    "routing": MIDDLE | {"routing"},
    "autoscale": MIDDLE | {"autoscale"},
    "accounts": MIDDLE | {"accounts"},
    "planning": MIDDLE | {"planning"},
    "core": BELOW_CORE | {"core"},
    "anthropic_api": BELOW_CORE | {"core", "anthropic_api"},
    "openai_api": BELOW_CORE | {"core", "openai_api", "anthropic_api"},
    "grpc_api": BELOW_CORE | {"core", "grpc_api"},
}
OUTSIDE_THE_GATEWAY = {"workers", "controlplane", "planner", "diptych_server", "diptych", "bench", "tests"}


def _part(module: str) -> str | None:
    """The part of gateway/ a module belongs to: its package, or a module at the root (None: the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for module, path in modules_under(GATEWAY).items():
        if module == ENTRY_POINT or _part(module) is None:
            continue
        allowed = ALLOWED[_part(module)]
        for line, target in imports(path):
            if target.startswith("gateway.") and target != ENTRY_POINT and _part(target) not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports that run back up or across:\n" + "\n".join(wrong)


def test_every_module_belongs_to_a_known_part():
    unknown = {m for m in modules_under(GATEWAY) if m != ENTRY_POINT and _part(m) not in (None, *ALLOWED)}
    assert not unknown, f"modules outside the gateway's layers (add them to ALLOWED): {sorted(unknown)}"


def test_nothing_imports_the_entry_point_and_no_gateway_module_reaches_outside_its_process():
    wrong = []
    for module, path in modules_under(GATEWAY).items():
        for line, target in imports(path):
            if target == ENTRY_POINT and module != ENTRY_POINT:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the entry point")
            if target.split(".")[0] in OUTSIDE_THE_GATEWAY:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}, outside the gateway")
    assert not wrong, "\n".join(wrong)


def test_the_modules_imports_form_no_circle():
    found = import_circles(modules_under(GATEWAY))
    assert not found, "modules that import each other: " + "; ".join(" -> ".join(c) for c in found)


def test_the_parser_finds_the_imports_the_rules_judge():
    """The checks above are not vacuous: the parser finds the imports they judge."""
    pipeline = imports(GATEWAY / "core" / "pipeline.py")
    assert any(target == "gateway.core.request_path" for _, target in pipeline)
    router = imports(GATEWAY / "routing" / "router.py")
    assert any(target == "gateway.fleet.live_load" for _, target in router)
