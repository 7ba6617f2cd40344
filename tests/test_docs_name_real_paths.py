"""Every file, module and `python -m` command the docs name exists: a doc that cites a module moved or
renamed sends its reader nowhere. A file may be named by its path from the repository's root or by its end
(`engine/kv_transfer.py`, as a doc about the workers names it); a module by its dotted name, its last part
perhaps a name inside it."""

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILE_NAME = re.compile(r"`([A-Za-z_][\w/.\-]*\.(?:py|ts|tsx|sh|toml|yaml|yml|proto))(?::\d+)?`")
MODULE_NAME = re.compile(
    r"`((?:gateway|workers|diptych_common|diptych_server|planner|bench|controlplane)(?:\.\w+){2,})`"
)
RUN_MODULE = re.compile(r"python -m ((?:gateway|workers|diptych_common|diptych_server|planner|bench)(?:\.\w+)*)")
# Where a dotted name's first part lives, when it is not a folder of the root.
PACKAGE_ROOTS = {"controlplane": "platform/controlplane"}


@cache
def tracked_files() -> tuple[str, ...]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(name for name in listed.splitlines() if (ROOT / name).exists())


def documents() -> list[str]:
    return [
        name
        for name in tracked_files()
        if name.endswith(".md") and (name.startswith("docs/") or name.endswith("README.md"))
    ]


def names_a_file(path: str) -> bool:
    return any(name == path or name.endswith(f"/{path}") for name in tracked_files())


def module_file(dotted: list[str]) -> Path | None:
    base = ROOT / PACKAGE_ROOTS.get(dotted[0], dotted[0]) / Path(*dotted[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def names_a_module(dotted: str, attribute_allowed: bool = True) -> bool:
    """A module, or (`attribute_allowed`) a name a module defines at its top."""
    parts = dotted.split(".")
    if module_file(parts) is not None:
        return True
    container = module_file(parts[:-1]) if attribute_allowed else None
    defined = re.compile(rf"^(?:(?:async )?def |class )?{re.escape(parts[-1])}\b", re.MULTILINE)
    return container is not None and defined.search(container.read_text()) is not None


def missing_in(document: str) -> list[str]:
    text = (ROOT / document).read_text()
    missing = [path for path in FILE_NAME.findall(text) if not names_a_file(path)]
    missing += [name for name in MODULE_NAME.findall(text) if not names_a_module(name)]
    missing += [name for name in RUN_MODULE.findall(text) if not names_a_module(name, attribute_allowed=False)]
    return sorted(set(missing))


def test_the_docs_are_found():
    assert "docs/engine.md" in documents() and "README.md" in documents()


@pytest.mark.parametrize("document", documents())
def test_every_path_a_doc_names_exists(document):
    assert missing_in(document) == [], f"{document} names what the tree does not hold"


def test_a_moved_module_is_caught():
    assert not names_a_file("gateway/routing.py") and names_a_file("routing/router.py")
    assert not names_a_module("gateway.core.routing") and names_a_module("gateway.core.request_path.RequestPath")
    assert names_a_module("controlplane.metering.services")
    assert names_a_module("bench.hosts.run", attribute_allowed=False)
    assert not names_a_module("bench.hosts.gone", attribute_allowed=False)
