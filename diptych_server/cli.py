"""The `diptych` command line. Each sub-command imports only what its process needs: the gateway and
the workers never import Django, and the control plane never imports torch."""

import argparse
import logging
import os
import sys
from pathlib import Path

from diptych_common.event_loop import serve_forever
from diptych_common.logs import LOG_FORMATS, configure_logging, log_format
from diptych_common.supervision import stop_with_supervisor
from diptych_common.tracing import configure_tracing

DEFAULT_CONTROL_PLANE_URL = "http://127.0.0.1:8000"


def main(argv: list[str] | None = None) -> int:
    stop_with_supervisor()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        os.environ["DIPTYCH_LOG_FORMAT"] = log_format(args.log_format)  # processes `up` starts log alike
    except ValueError as error:
        parser.error(str(error))
    configure_logging()
    if args.otlp_endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint  # and trace alike
    configure_tracing(f"diptych-{args.command}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    return args.run(args) or 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diptych", description="Disaggregated LLM serving.")
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default=None, help="text or JSON lines (default: DIPTYCH_LOG_FORMAT, text)"
    )
    parser.add_argument(
        "--otlp-endpoint",
        default="",
        help="export traces over OTLP/gRPC to this collector (default: OTEL_EXPORTER_OTLP_ENDPOINT; off without it)",
    )
    commands = parser.add_subparsers(required=True, metavar="command", dest="command")

    for add in (_add_up, _add_control_plane, _add_jobs, _add_gateway, _add_worker, _add_kv_tier, _add_plan, _add_model):
        add(commands)
    return parser


def _add_up(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="run the whole platform on this machine and send a demo request")
    up.add_argument("--state-dir", type=Path, default=Path(".diptych"))
    up.add_argument("--control-plane-port", type=int, default=8000)
    up.add_argument("--gateway-port", type=int, default=50051)
    up.add_argument("--http-port", type=int, default=8080, help="the gateway's OpenAI-compatible HTTP API")
    up.add_argument("--metrics-port", type=int, default=9090)
    up.add_argument(
        "--kv-tier",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the shared KV tier's store and point the workers at it",
    )
    up.set_defaults(run=_run_up)


def _add_control_plane(commands: argparse._SubParsersAction) -> None:
    control_plane = commands.add_parser("control-plane", help="run the control plane's HTTP server")
    control_plane.add_argument("--host", default="127.0.0.1")
    control_plane.add_argument("--port", type=int, default=8000)
    control_plane.add_argument("--processes", type=int, default=2)
    control_plane.set_defaults(run=_run_control_plane)


def _add_jobs(commands: argparse._SubParsersAction) -> None:
    jobs = commands.add_parser("jobs", help="run the control plane's background jobs (a Celery worker with beat)")
    jobs.set_defaults(run=_run_jobs)


def _add_gateway(commands: argparse._SubParsersAction) -> None:
    gateway = commands.add_parser("gateway", help="run the gRPC gateway")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=50051)
    gateway.add_argument("--mode", choices=["auto", "split", "colocated"], default="auto")
    gateway.add_argument("--http-port", type=int, default=8080, help="the OpenAI-compatible HTTP API")
    gateway.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics over HTTP")
    gateway.add_argument(
        "--region",
        default=os.environ.get("DIPTYCH_REGION", ""),
        help="prefer workers of this region; other regions serve when none is usable here",
    )
    gateway.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("DIPTYCH_STATE_DIR", ".diptych")),
        help="where the usage spool lives while the control plane is unreachable",
    )
    gateway.add_argument(
        "--skip-split-below",
        type=int,
        default=32,
        metavar="TOKENS",
        help="run prompts with at most this many uncached tokens wholly on the decode worker (0: never)",
    )
    gateway.add_argument(
        "--routing-policy",
        default="cache_aware",
        metavar="NAME",
        help="how a worker of a phase is picked (gateway/routing/policies/): cache_aware, the least work counting "
        "each worker's prefix cache (default), or power_of_two, the less loaded of two drawn at random",
    )
    gateway.add_argument(
        "--prefill-overflow-tokens",
        type=int,
        default=2048,
        metavar="TOKENS",
        help="when every prefill worker has this many prompt tokens still to compute, run a request "
        "wholly on its decode worker if that one has fewer (0: never; raise it where prefill "
        "is fast)",
    )
    gateway.add_argument(
        "--worker-timeout", type=float, default=30.0, help="seconds to wait for a prefill's first token or KV hand-off"
    )
    gateway.add_argument(
        "--token-timeout", type=float, default=10.0, help="seconds to wait for each following token of a stream"
    )
    gateway.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=2000.0,
        help="the time-to-first-token target whose recent attainment the autoscaling signals export",
    )
    gateway.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=200.0,
        help="the time-per-output-token target whose recent attainment the autoscaling signals export",
    )
    gateway.add_argument(
        "--autoscale-policy",
        type=Path,
        default=None,
        metavar="PATH",
        help="the scaling policy as JSON: targets, min/max replicas and the planner's baseline per fleet "
        "(gateway/autoscale/policy_file.py; default: the built-in targets, 1 to 16 replicas)",
    )
    _add_control_plane_url(gateway)
    gateway.set_defaults(run=_run_gateway)


def _add_worker(commands: argparse._SubParsersAction) -> None:
    worker = commands.add_parser("worker", help="run a prefill, decode or colocated worker")
    worker.add_argument("--role", choices=["prefill", "decode", "colocated"], required=True)
    _add_worker_model_arguments(worker.add_argument_group("the model"))
    _add_worker_address_arguments(worker.add_argument_group("where it serves"))
    _add_worker_engine_arguments(worker.add_argument_group("the engine"))
    _add_worker_kv_arguments(worker.add_argument_group("the KV hand-off and the KV tier"))
    from workers.spec_decode.config import add_cli_arguments as add_speculative_arguments  # argparse alone

    add_speculative_arguments(worker)
    _add_control_plane_url(worker)
    worker.set_defaults(run=_run_worker)


def _add_worker_model_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model",
        default="",
        help="the fleet's model (default: as the catalog has it; diptych-tiny with an explicit --model-source)",
    )
    group.add_argument(
        "--model-source",
        default="",
        help="builtin:<name> or a local Hugging Face model directory (default: the fleet's model as the catalog "
        "has it, its published files fetched into --artifact-cache)",
    )
    group.add_argument(
        "--artifact-cache",
        type=Path,
        default=Path(os.environ.get("DIPTYCH_ARTIFACT_CACHE", "~/.cache/diptych/artifacts")),
        help="where published model files are kept, checked by sha256 (default: DIPTYCH_ARTIFACT_CACHE, "
        "~/.cache/diptych/artifacts)",
    )


def _add_worker_address_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument(
        "--host-id",
        default="",
        help="which host this worker runs on: prefill and decode workers of one host id hand KV over through "
        "shared memory (default: DIPTYCH_HOST_ID, else this machine's id and network namespace)",
    )
    group.add_argument("--port", type=int, default=0, help="0 picks a free port")
    group.add_argument("--name", default="")
    group.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics over HTTP (0: off)")


def _add_worker_engine_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    group.add_argument("--device", default="cpu", help="cpu, or cuda[:n] (bfloat16 weights and KV)")
    group.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks: this process and N-1 follower processes it starts "
        "(gloo on the CPU; NCCL on CUDA, rank r on cuda:n+r under --device cuda:n)",
    )
    group.add_argument("--kv-cache-mib", type=int, default=256, help="memory for the paged KV cache")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (equal on prefill and decode)")
    group.add_argument(
        "--token-budget", type=int, default=512, help="tokens per engine step (long prompts are chunked)"
    )
    group.add_argument("--max-running", type=int, default=64, help="sequences per engine step at most")
    group.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, replay steps from graphs captured at start-up (with --attention triton every step, "
        "else decode steps)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule each engine step while the one before it runs (docs/engine.md)",
    )
    group.add_argument(
        "--attention",
        choices=["auto", "gather", "paged-cpu", "flash-varlen", "triton"],  # workers.models.backends.ATTENTION_BACKENDS
        default="auto",
        help="the attention backend: flash-varlen (CUDA, half precision, --block-size 256) reads the paged KV in "
        "place in one kernel call per layer; paged-cpu (CPU, float32, built with the machine's C++ compiler) "
        "does for decoding rows; gather runs anywhere; auto: the first of those that can run",
    )


def _add_worker_kv_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--kv-port", type=int, default=0, help="decode workers: the KV data port (0 picks a free port)")
    group.add_argument(
        "--kv-nixl",
        choices=["auto", "on", "off"],
        default="auto",
        help="hand KV off over NIXL (one-sided writes; UCX picks RDMA, CUDA IPC or TCP) where both workers run "
        "an agent: auto where NIXL is installed; shared memory still serves workers on one host",
    )
    group.add_argument(
        "--kv-shm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill workers: hand KV to a decode worker on this host through shared memory (--no-kv-shm: "
        "over NIXL or TCP, as between hosts)",
    )
    group.add_argument(
        "--kv-tier", default="", metavar="HOST:PORT", help="the shared KV tier's store (diptych kv-tier); default: none"
    )


def _add_kv_tier(commands: argparse._SubParsersAction) -> None:
    from workers.kv_tier.options import add_tier_arguments  # argparse alone

    kv_tier = commands.add_parser("kv-tier", help="run the shared KV tier's store (host memory, disk) for workers")
    add_tier_arguments(kv_tier)
    kv_tier.set_defaults(run=_run_kv_tier)


def _add_plan(commands: argparse._SubParsersAction) -> None:
    from planner.cli import add_arguments as add_plan_arguments  # argparse alone

    plan = commands.add_parser(
        "plan", help="find the cheapest split and colocated fleets meeting a TTFT and TPOT SLO (simulated)"
    )
    add_plan_arguments(plan)
    plan.set_defaults(run=_run_plan)


def _add_model(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="built-in models")
    model_commands = model.add_subparsers(required=True, metavar="action")
    save = model_commands.add_parser("save", help="write a built-in model as a Hugging Face model directory")
    save.add_argument("name")
    save.add_argument("directory", type=Path)
    save.set_defaults(run=_run_model_save)
    register = model_commands.add_parser(
        "register",
        help="add a local Hugging Face model directory to the catalog, with a prefill, a decode and a "
        "colocated fleet; prints the worker command of each, with a fresh fleet token (through the running "
        "control plane's internal API: DIPTYCH_INTERNAL_TOKEN)",
    )
    register.add_argument("name", help="the model's name in the API (the `model` of a request)")
    register.add_argument("directory", type=Path)
    register.add_argument("--json", action="store_true", help="print the fleet tokens as one JSON object")
    register.add_argument(
        "--revision",
        default="",
        help="name of the published revision (default: the first 12 hex digits of the sha256 of its files' list)",
    )
    _add_control_plane_url(register)
    register.set_defaults(run=_run_model_register)


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

    return run_up(
        args.state_dir, args.control_plane_port, args.gateway_port, args.metrics_port, args.http_port, args.kv_tier
    )


def _run_control_plane(args) -> None:
    from diptych_server.control_plane import run_control_plane

    run_control_plane(args.host, args.port, args.processes)


def _run_jobs(_args: argparse.Namespace) -> None:
    from diptych_server.control_plane import run_jobs

    run_jobs()


def _run_gateway(args) -> None:
    from gateway.autoscale.decision import ScalingPolicy
    from gateway.autoscale.policy_file import load_policy
    from gateway.autoscale.signals import SloTargets
    from gateway.core.request_path import Timeouts
    from gateway.main import GatewayConfig, serve
    from gateway.routing.policies import POLICIES
    from gateway.routing.route import ServingMode

    if args.routing_policy not in POLICIES:
        raise SystemExit(f"diptych gateway: --routing-policy is one of {', '.join(sorted(POLICIES))}")
    try:
        slo = SloTargets(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000)
        policy = load_policy(args.autoscale_policy) if args.autoscale_policy else ScalingPolicy()
    except ValueError as error:
        raise SystemExit(f"diptych gateway: {error}") from None
    serve_forever(
        serve(
            GatewayConfig(
                host=args.host,
                port=args.port,
                http_port=args.http_port,
                metrics_port=args.metrics_port,
                control_plane_url=args.control_plane_url,
                internal_token=_require_env("DIPTYCH_INTERNAL_TOKEN"),
                mode=ServingMode(args.mode),
                state_dir=args.state_dir,
                region=args.region,
                redis_url=os.environ.get("REDIS_URL") or None,
                skip_split_below=args.skip_split_below,
                prefill_overflow_tokens=args.prefill_overflow_tokens,
                routing_policy=args.routing_policy,
                timeouts=Timeouts(
                    first_token_s=args.worker_timeout,
                    kv_delivery_s=args.worker_timeout,
                    next_token_s=args.token_timeout,
                ),
                slo=slo,
                autoscale_policy=policy,
            )
        )
    )


def _run_worker(args) -> int:
    from diptych_common.artifacts import ArtifactError
    from workers.engine.core import EngineConfig
    from workers.kv_connector.nixl import nixl_unavailable
    from workers.main import serve
    from workers.serving.config import WorkerConfig
    from workers.serving.server import Role
    from workers.spec_decode.config import spec_config_from_args

    try:
        speculative = spec_config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"diptych worker: {error}") from None
    if args.kv_nixl == "on" and (reason := nixl_unavailable()):
        raise SystemExit(f"diptych worker: --kv-nixl on: {reason}")
    engine_config = EngineConfig(
        block_size=args.block_size,
        kv_cache_mib=args.kv_cache_mib,
        token_budget=args.token_budget,
        max_running=args.max_running,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
        attention=args.attention,
        speculative=speculative,
    )
    config = WorkerConfig(
        role=Role(args.role),
        control_plane_url=args.control_plane_url,
        fleet_token=_require_env("DIPTYCH_FLEET_TOKEN"),
        name=args.name or f"{args.role}-{os.getpid()}",
        model=args.model,
        model_source=args.model_source,
        host=args.host,
        port=args.port,
        threads=args.threads,
        engine=engine_config,
        kv_port=args.kv_port,
        metrics_port=args.metrics_port,
        kv_tier=args.kv_tier,
        tensor_parallel=args.tensor_parallel,
        artifact_cache=args.artifact_cache,
        kv_nixl=args.kv_nixl,
        kv_shm=args.kv_shm,
        host_id=args.host_id,
    )
    try:
        serve_forever(serve(config))
    except ArtifactError as error:
        logging.getLogger("diptych.worker").critical("the worker refuses to start: %s", error)
        return 1
    return 0


def _run_kv_tier(args) -> int:
    from workers.kv_tier.server import run

    return run(args)


def _run_plan(args) -> int:
    from planner.cli import run

    return run(args)


def _run_model_save(args) -> None:
    from workers.runner.model_loader import save_builtin_model

    save_builtin_model(args.name, args.directory)
    print(f"wrote {args.name} to {args.directory}")


def _run_model_register(args) -> int:
    import json

    from diptych_server.model_catalog import RegistrationError, register_model

    internal_token = _require_env("DIPTYCH_INTERNAL_TOKEN")
    try:
        model = register_model(args.control_plane_url, internal_token, args.name, args.directory, args.revision)
    except RegistrationError as error:
        print(f"diptych model register: {error}", file=sys.stderr)
        return 2
    source = str(args.directory.resolve())  # the directory published
    if args.json:
        registered = {"model": model.name, "source": source, "revision": model.revision}
        print(json.dumps({**registered, "fleet_tokens": model.fleet_tokens}))
        return 0
    print(
        f"{model.name} ({source}, {model.context_length} tokens of context) is in the catalog, published "
        f"as revision {model.revision}; workers of an earlier revision drain once one of this revision is ready."
    )
    if not model.fleet_tokens:
        print("Its fleets keep their tokens: start its workers with them (diptych worker --role ROLE).")
        return 0
    print("Start its workers (their tokens are new; earlier ones no longer work):")
    for role, token in model.fleet_tokens.items():
        print(f"  DIPTYCH_FLEET_TOKEN={token} diptych worker --role {role}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
