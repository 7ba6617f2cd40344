"""The KV tier store process's command-line options, shared by `python -m workers.kv_tier.server` and
`diptych kv-tier` (argparse alone: the `diptych` command line imports it for every sub-command)."""

import argparse
import os
from pathlib import Path


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--memory-mib", type=int, default=1024, help="host memory for blocks")
    parser.add_argument("--disk-dir", type=Path, default=None, help="where blocks spill to (none: no disk)")
    parser.add_argument("--disk-mib", type=int, default=0, help="disk for blocks (0: no disk)")
    parser.add_argument(
        "--control-plane-url",
        default=os.environ.get("DIPTYCH_CONTROL_PLANE_URL", "http://127.0.0.1:8000"),
        help="where to ask for the worker RPC secret when DIPTYCH_WORKER_RPC_SECRET is not set",
    )


def tier_arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    if args.memory_mib < 0 or args.disk_mib < 0:
        return "--memory-mib and --disk-mib must not be negative"
    if args.disk_mib and args.disk_dir is None:
        return "--disk-mib needs --disk-dir, the directory blocks spill to"
    if args.memory_mib == 0 and args.disk_mib == 0:
        return "the KV tier needs room: give --memory-mib, or --disk-mib with --disk-dir"
    return None
