"""The batches app's modules depend one way: the services that create and cancel a batch hand it to a Celery
task (`tasks`), which runs a slice of it (`runner`), which records the run's state changes (`run_services`).
Nothing below imports what is above it, imports inside functions and for type checking included, so they
form no circle."""

from pathlib import Path

from tests.import_graph import import_circles, imports, module_name

PLATFORM = Path(__file__).resolve().parents[2] / "platform"
BATCHES = PLATFORM / "controlplane" / "batches"
RUN_LAYERS = ["run_services", "runner", "tasks", "services"]  # each may import those before it, none after it


def _batches_modules() -> dict[str, Path]:
    return {module_name(path, PLATFORM): path for path in BATCHES.glob("*.py")}


def test_the_batches_modules_imports_form_no_circle():
    found = import_circles(_batches_modules(), PLATFORM)
    assert not found, "modules that import each other: " + "; ".join(" -> ".join(c) for c in found)


def test_each_part_of_a_run_imports_only_the_parts_below_it():
    wrong = []
    for position, layer in enumerate(RUN_LAYERS):
        above = {f"controlplane.batches.{name}" for name in RUN_LAYERS[position + 1 :]}
        for line, target in imports(BATCHES / f"{layer}.py", PLATFORM):
            if target in above:
                wrong.append(f"{layer}.py:{line} imports {target}")
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)
