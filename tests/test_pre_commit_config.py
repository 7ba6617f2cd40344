"""The pre-commit hooks run what `make lint` runs, command for command, so that the two cannot drift."""

import re
from pathlib import Path

import yaml

REPO = Path(__file__).parent.parent


def lint_commands() -> list[str]:
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "the Makefile has no lint target"
    commands = [line.strip().replace("$(VENV)", ".venv") for line in recipe.group(1).splitlines()]
    return [command.removesuffix(" .") for command in commands]  # the tree, where a hook gets the staged files


def hook_commands() -> list[str]:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    return [hook["entry"] for repo in config["repos"] for hook in repo["hooks"]]


def test_the_pre_commit_hooks_run_make_lints_commands():
    assert hook_commands() == lint_commands()


def test_only_the_whole_tree_type_check_ignores_the_staged_files():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    whole_tree = {
        hook["id"] for repo in config["repos"] for hook in repo["hooks"] if not hook.get("pass_filenames", True)
    }
    assert whole_tree == {"mypy"}
