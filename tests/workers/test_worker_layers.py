"""The worker's packages depend one way: models ← runner ← the engine's parts ← serving ← the processes' mains.

Every module under workers/ is parsed, imports inside functions and under TYPE_CHECKING included. The
model code (`models`) knows nothing of runners; the runner (`runner`) nothing of engines or services;
speculative decoding nothing of the engine that calls it; the engine with its KV connectors, speculative
decoding and the KV tier's client side never reach the gRPC service (`serving`); only a process's entry
point (`workers.main`, the KV tier's own server) wires it all, and nothing imports an entry point. No
worker module imports the gateway, the control plane, the planner, the process launcher or the
benchmarks, and the modules' imports (those for type checking too) form no circle.
"""

from pathlib import Path

from tests.import_graph import ROOT, circles, import_circles, imports, modules_under

WORKERS = ROOT / "workers"
ENTRY_POINTS = {"workers.main", "workers.kv_tier.server"}
ENGINE_PARTS = frozenset({"engine", "kv_connector", "spec_decode"})
ALLOWED: dict[str, frozenset[str]] = {  # group → the groups its modules may import (their own included)
    "models": frozenset({"models"}),
    "runner": frozenset({"runner", "models"}),
    "structured": frozenset({"structured"}),
    "kv_tier": frozenset({"kv_tier", "runner"}),
    # The engine owns the connector interface it calls (engine/connector.py): the connectors import the
    # engine, never the other way.
    "engine": frozenset({"engine", "spec_decode", "runner", "models", "structured"}),
    "kv_connector": ENGINE_PARTS | {"runner", "models", "structured", "kv_tier"},
    # The engine lends the draft model what it needs of the engine (its pool's block tables): speculative
    # decoding sits below the engine that calls it.
    "spec_decode": frozenset({"spec_decode", "runner", "models"}),
    "serving": ENGINE_PARTS | {"serving", "runner", "models", "structured", "kv_tier"},
}
OTHER_FIRST_PARTY = {"gateway", "controlplane", "planner", "diptych_server", "bench", "tests", "diptych"}


def _group(module: str) -> str | None:
    """The package of workers/ a module belongs to (None: the workers package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] != "main") else None


def _worker_modules() -> dict[str, Path]:
    return modules_under(WORKERS)


def test_each_package_imports_only_the_ones_below_it():
    wrong = []
    for module, path in _worker_modules().items():
        if module in ENTRY_POINTS or _group(module) is None:
            continue
        allowed = ALLOWED[_group(module)]
        for line, target in imports(path):
            if target.startswith("workers.") and target not in ENTRY_POINTS and _group(target) not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_nothing_imports_an_entry_point_and_no_worker_module_reaches_outside_its_process():
    wrong = []
    for module, path in _worker_modules().items():
        for line, target in imports(path):
            if target in ENTRY_POINTS and target != module:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the entry point {target}")
            if target.split(".")[0] in OTHER_FIRST_PARTY:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}, outside the worker")
    assert not wrong, "\n".join(wrong)


def test_the_modules_imports_form_no_circle():
    found = import_circles(_worker_modules())
    assert not found, "modules that import each other: " + "; ".join(" -> ".join(c) for c in found)


def test_the_parser_finds_the_imports_the_rules_judge():
    """The checks above are not vacuous: the parser finds the imports they judge."""
    runner = imports(WORKERS / "runner" / "model_runner.py")
    assert any(target == "workers.models.attention" for _, target in runner)
    sampling = imports(WORKERS / "engine" / "sampling.py")
    assert any(target == "workers.models.device_values" for _, target in sampling)
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
