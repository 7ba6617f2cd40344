"""The SDK README's asyncio snippet type-checks under `mypy --strict` as a user would write it, a message list built
ahead of the call included (a `list[dict[str, str]]`, which `messages` must take)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "sdk" / "README.md"


def readme_snippet(heading: str) -> str:
    """The first Python block under the README's `## {heading}`."""
    section = README.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"no python block under ## {heading}"
    return match.group(1)


def test_the_async_snippet_passes_mypy_strict(tmp_path):
    snippet = readme_snippet("Async")
    assert "messages = [" in snippet  # the message list built ahead of the call is what this checks
    program = tmp_path / "readme_async.py"
    program.write_text("import diptych\n\n\nasync def main() -> None:\n" + textwrap.indent(snippet, "    "))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), str(program)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
