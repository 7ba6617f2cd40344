#!/usr/bin/env python
"""Command-line entry point of the Diptych control plane (Django)."""

import os
import sys
from pathlib import Path

# `platform/` is a source folder, not a package: importing it as `platform` would shadow the
# standard library's module, so its contents go on sys.path instead.
PLATFORM_SOURCE_DIR = Path(__file__).resolve().parent / "platform"


def main() -> None:
    sys.path.insert(0, str(PLATFORM_SOURCE_DIR))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
