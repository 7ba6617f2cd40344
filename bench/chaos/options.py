"""The command line of `python -m bench.chaos`: every option, its default and the checks on its values."""

import argparse
from pathlib import Path

import bench.chaos
from bench.chaos.faults import VICTIM_KINDS
from bench.chaos.harness import KV_PATH_WORKER_ARGS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=bench.chaos.__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--clients-per-org", type=int, default=3, help="concurrent streaming clients per organization")
    parser.add_argument(
        "--victims",
        nargs="+",
        choices=VICTIM_KINDS,
        default=list(VICTIM_KINDS),
        help="the kinds of process to kill (default: all five)",
    )
    parser.add_argument(
        "--kill-interval",
        type=float,
        nargs=2,
        default=[2.0, 6.0],
        metavar=("MIN", "MAX"),
        help="seconds between a victim's return and the next kill (default 2 6)",
    )
    parser.add_argument(
        "--down-time",
        type=float,
        nargs=2,
        default=[0.5, 3.0],
        metavar=("MIN", "MAX"),
        help="seconds between a kill and the restart (default 0.5 3)",
    )
    parser.add_argument("--max-kills", type=int, help="kill at most this many times (default: until the load ends)")
    parser.add_argument(
        "--tail",
        type=float,
        default=5.0,
        help="seconds the load goes on after the last victim serves again (default 5)",
    )
    parser.add_argument(
        "--kv-path",
        choices=list(KV_PATH_WORKER_ARGS),
        default="shm",
        help="how the KV moves between the workers (all on this host): shared memory, NIXL or TCP",
    )
    parser.add_argument(
        "--gateways", type=int, default=2, help="gateways, each a victim of its own (default 2, the chart's replicas)"
    )
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--max-tokens",
        type=int,
        nargs=2,
        default=[8, 64],
        metavar=("MIN", "MAX"),
        help="output tokens per request (end of sequence ignored)",
    )
    parser.add_argument(
        "--no-batches",
        dest="batches",
        action="store_false",
        help="no Batch API traffic (the jobs process then runs only if it is a victim)",
    )
    parser.add_argument(
        "--batch-every",
        type=float,
        nargs=2,
        default=[6.0, 14.0],
        metavar=("MIN", "MAX"),
        help="seconds between one organization's batches (default 6 14)",
    )
    parser.add_argument("--batch-lines", type=int, nargs=2, default=[3, 10], metavar=("MIN", "MAX"))
    parser.add_argument("--batch-max-tokens", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    parser.add_argument("--cancel-share", type=float, default=0.3, help="the share of batches cancelled (default 0.3)")
    parser.add_argument(
        "--batch-timeout",
        type=float,
        default=240.0,
        help="seconds to wait for every batch to end after the load",
    )
    parser.add_argument("--request-timeout", type=float, default=60.0, help="each request's gRPC deadline in seconds")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the gateway's usage to reach the ledger after the load",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="across hosts made of network namespaces (bench.hosts, needs root): hosts lost, links cut, the "
        "gateway partitioned from the control plane, instead of processes killed on loopback; --victims, the "
        "worker counts and the batches do not apply",
    )
    parser.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress lines")
    parser.add_argument("--seed", type=int, default=0, help="seeds the victims, pauses, prompts and lengths")
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="logs and databases here, kept (default: a temporary directory, kept only on failure)",
    )
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in (
        "kill_interval",
        "down_time",
        "prompt_tokens",
        "max_tokens",
        "batch_every",
        "batch_lines",
        "batch_max_tokens",
    ):
        low, high = getattr(args, name)
        if low < 0 or high < low:
            parser.error(f"--{name.replace('_', '-')} takes MIN MAX with 0 <= MIN <= MAX, not {low} {high}")
    if min(args.prompt_tokens[0], args.max_tokens[0], args.batch_lines[0], args.batch_max_tokens[0]) < 1:
        parser.error("--prompt-tokens, --max-tokens, --batch-lines and --batch-max-tokens need MIN of at least 1")
    if not 0 <= args.cancel_share <= 1:
        parser.error(f"--cancel-share must be between 0 and 1, not {args.cancel_share}")
    for name in (
        "duration",
        "clients_per_org",
        "gateways",
        "prefill_workers",
        "decode_workers",
        "request_timeout",
        "progress_every",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    if args.tail < 0:
        parser.error(f"--tail must be 0 or more, not {args.tail}")
    if args.max_kills is not None and args.max_kills < 0:
        parser.error(f"--max-kills must be 0 or more, not {args.max_kills}")
    return args
