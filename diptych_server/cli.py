"""The `diptych` command line. Each sub-command imports only what its process needs: the gateway and
the workers never import Django, and the control plane never imports torch."""

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

DEFAULT_CONTROL_PLANE_URL = "http://127.0.0.1:8000"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    return args.run(args) or 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diptych", description="Disaggregated LLM serving.")
    commands = parser.add_subparsers(required=True, metavar="command")

    up = commands.add_parser("up", help="run the whole platform on this machine and send a demo request")
    up.add_argument("--state-dir", type=Path, default=Path(".diptych"))
    up.add_argument("--control-plane-port", type=int, default=8000)
    up.add_argument("--gateway-port", type=int, default=50051)
    up.add_argument("--metrics-port", type=int, default=9090)
    up.set_defaults(run=_run_up)

    control_plane = commands.add_parser("control-plane", help="run the control plane's HTTP server")
    control_plane.add_argument("--host", default="127.0.0.1")
    control_plane.add_argument("--port", type=int, default=8000)
    control_plane.add_argument("--processes", type=int, default=2)
    control_plane.set_defaults(run=_run_control_plane)

    jobs = commands.add_parser("jobs", help="run the control plane's background jobs (a Celery worker with beat)")
    jobs.set_defaults(run=_run_jobs)

    gateway = commands.add_parser("gateway", help="run the gRPC gateway")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=50051)
    gateway.add_argument("--mode", choices=["auto", "split", "colocated"], default="auto")
    gateway.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics over HTTP")
    _add_control_plane_url(gateway)
    gateway.set_defaults(run=_run_gateway)

    worker = commands.add_parser("worker", help="run a prefill, decode or colocated worker")
    worker.add_argument("--role", choices=["prefill", "decode", "colocated"], required=True)
    worker.add_argument("--model", default="diptych-tiny")
    worker.add_argument("--model-source", default="builtin:diptych-tiny",
                        help="builtin:<name> or a local Hugging Face model directory")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=0, help="0 picks a free port")
    worker.add_argument("--name", default="")
    worker.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    _add_control_plane_url(worker)
    worker.set_defaults(run=_run_worker)

    model = commands.add_parser("model", help="built-in models")
    model_commands = model.add_subparsers(required=True, metavar="action")
    save = model_commands.add_parser("save", help="write a built-in model as a Hugging Face model directory")
    save.add_argument("name")
    save.add_argument("directory", type=Path)
    save.set_defaults(run=_run_model_save)
    return parser


def _add_control_plane_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control-plane-url", default=os.environ.get("DIPTYCH_CONTROL_PLANE_URL", DEFAULT_CONTROL_PLANE_URL)
    )


def _require_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        sys.exit(f"diptych: set {name} in the environment")
    return value


def _run_up(args) -> int:
    from diptych_server.up import run_up

    return run_up(args.state_dir, args.control_plane_port, args.gateway_port, args.metrics_port)


def _run_control_plane(args) -> None:
    from diptych_server.control_plane import run_control_plane

    run_control_plane(args.host, args.port, args.processes)


def _run_jobs(args) -> None:
    from diptych_server.control_plane import run_jobs

    run_jobs()


def _run_gateway(args) -> None:
    from gateway.main import serve
    from gateway.routing import ServingMode

    asyncio.run(serve(
        host=args.host, port=args.port, metrics_port=args.metrics_port, control_plane_url=args.control_plane_url,
        internal_token=_require_env("DIPTYCH_INTERNAL_TOKEN"), mode=ServingMode(args.mode),
    ))


def _run_worker(args) -> None:
    from workers.main import serve
    from workers.server import Role

    asyncio.run(serve(
        role=Role(args.role), model=args.model, model_source=args.model_source, host=args.host, port=args.port,
        control_plane_url=args.control_plane_url, fleet_token=_require_env("DIPTYCH_FLEET_TOKEN"),
        name=args.name or f"{args.role}-{os.getpid()}", threads=args.threads,
    ))


def _run_model_save(args) -> None:
    from workers.model_loader import save_builtin_model

    save_builtin_model(args.name, args.directory)
    print(f"wrote {args.name} to {args.directory}")


if __name__ == "__main__":
    sys.exit(main())
