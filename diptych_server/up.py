"""`diptych up`: the whole platform on this machine, on its embedded default (SQLite, the built-in
tiny model, a broker-less Celery), with a demo organization and API key and one demo request.

It stops every process it started however it is told to stop: Ctrl-C (SIGINT, handled even when it was
started with SIGINT ignored, as a shell's background job is), SIGTERM or SIGHUP, with or without a reader
left on its output. If it is killed outright, its children stop on their own (`supervision.py`).
"""

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diptych_server.stack import Stack, StackError, free_port

# Long enough to run split (74 tokens of diptych-tiny): the gateway runs prompts of at most 32 uncached tokens
# wholly on the decode worker (its --skip-split-below).
DEMO_PROMPT = (
    "Disaggregated serving runs the prompt on a prefill worker, which builds the KV cache and samples the first "
    "token, then moves that cache to a decode worker, which extends it one token at a time:"
)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A staff user of this machine's platform only, to see fleets and workers on the dashboard; in production one is
# made with `manage.py createsuperuser` (docs/sdk.md, Dashboard).
DEMO_STAFF_EMAIL = "staff@diptych.local"
# The workers `up` runs, by name, with their roles; each serves Prometheus metrics on a free port of its own.
WORKERS = {"prefill-0": "prefill", "decode-0": "decode"}
KV_TIER_NAME = "kv-tier"
KV_TIER_MEMORY_MIB = 256
KV_TIER_DISK_MIB = 1024
SERVING = health_pb2.HealthCheckResponse.SERVING


def run_up(
    state_dir: Path,
    control_plane_port: int,
    gateway_port: int,
    metrics_port: int,
    http_port: int = 8080,
    kv_tier: bool = True,
) -> int:
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, _interrupt)
    stack = Stack(state_dir, control_plane_port=control_plane_port, supervised=True)
    try:
        _start(stack, gateway_port, metrics_port, http_port, kv_tier)
        _wait_for_interrupt(stack)
    except StackError as error:
        _say(f"\ndiptych up failed: {error}")
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        for stop_signal in STOP_SIGNALS:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(stop_signal, signal.SIG_IGN)
        _say("\nstopping every process ...")
        stack.stop()
    return 0


def write_env_file(
    state_dir: Path, *, api_key: str, base_url: str, http_url: str, control_plane_url: str, internal_token: str
) -> Path:
    """`state_dir/env`, readable by its owner only: what the SDK, any OpenAI client and the CLI need to reach this
    platform, as `export $(cat .diptych/env)` takes it."""
    env_file = state_dir / "env"
    env_file.write_text(
        f"DIPTYCH_API_KEY={api_key}\nDIPTYCH_BASE_URL={base_url}\nDIPTYCH_HTTP_URL={http_url}\n"
        f"DIPTYCH_ADMIN_URL={control_plane_url}\n"
        # for `diptych model register`, which calls the control plane's internal API
        f"DIPTYCH_CONTROL_PLANE_URL={control_plane_url}\nDIPTYCH_INTERNAL_TOKEN={internal_token}\n"
    )
    env_file.chmod(0o600)
    return env_file


def _start(stack: Stack, gateway_port: int, metrics_port: int, http_port: int, kv_tier: bool) -> None:
    _step(1, f"migrating the control plane's database and creating the demo organization ({stack.state_dir}/)")
    credentials = stack.prepare_control_plane(demo=True, staff_email=DEMO_STAFF_EMAIL)
    _step(2, f"starting the control plane on {stack.control_plane_url} and its background jobs")
    stack.start_control_plane()
    stack.start_jobs(DIPTYCH_GATEWAY_URL=f"http://127.0.0.1:{http_port}/v1")  # batches run through the gateway
    _step(3, "starting a prefill and a decode worker, each loading diptych-tiny")
    tier_options = _start_kv_tier(stack) if kv_tier else ()
    worker_metrics = {name: free_port() for name in WORKERS}
    for name, role in WORKERS.items():
        metrics = ("--metrics-port", str(worker_metrics[name]))
        stack.start_worker(name, role, credentials.fleet_tokens[role], 0, *metrics, *tier_options)
    worker_names = {}
    for worker in stack.wait_for_workers(list(WORKERS)):
        worker_names[worker["id"]] = worker["name"]
        _say(
            f"      {worker['role']:<8} {worker['name']} ({worker['id']}) at {worker['address']}, "
            f"metrics on :{worker_metrics[worker['name']]}"
        )
    _step(
        4,
        f"starting the gateway on 127.0.0.1:{gateway_port}, OpenAI-compatible HTTP on :{http_port} "
        f"(metrics on :{metrics_port})",
    )
    stack.start_gateway("gateway", gateway_port, metrics_port, http_port=http_port)
    base_url = f"grpc://127.0.0.1:{gateway_port}"
    env_file = write_env_file(
        stack.state_dir,
        api_key=credentials.api_key,
        base_url=base_url,
        http_url=f"http://127.0.0.1:{http_port}/v1",
        control_plane_url=stack.control_plane_url,
        internal_token=stack.internal_token,
    )
    _say(f"      demo credentials written to {env_file}")
    _step(5, "one demo request through the SDK, streamed")
    _demo_request(credentials.api_key, base_url, worker_names)
    _say(f"\nThe platform is running (logs in {stack.state_dir}/logs/). Ctrl-C stops it.")
    _say(f"  export $(cat {env_file})")
    _say(f"  control plane: {stack.control_plane_url}/api/v1/   gateway: {base_url}")
    _say(f"  OpenAI-compatible API: http://127.0.0.1:{http_port}/v1 (Authorization: Bearer $DIPTYCH_API_KEY)")
    scraped = [f"http://127.0.0.1:{metrics_port}/metrics (gateway)"]
    scraped += [f"http://127.0.0.1:{port}/metrics ({name})" for name, port in worker_metrics.items()]
    _say(f"  Prometheus metrics: {', '.join(scraped)}")
    if credentials.dashboard_password:
        _say(
            f"  dashboard: {stack.control_plane_url}/dashboard/ (sign in as {credentials.dashboard_email}, "
            f"password {credentials.dashboard_password})"
        )
    if credentials.staff_password:
        _say(
            f"  fleets and workers: the same dashboard as staff (sign in as {credentials.staff_email}, "
            f"password {credentials.staff_password})"
        )


def _start_kv_tier(stack: Stack, timeout: float = 30.0) -> tuple[str, ...]:
    """Starts the shared KV tier's store (host memory, spilling to the state directory) and waits until it
    serves; returns the workers' options that point them at it."""
    port = free_port()
    disk = stack.state_dir / "kv-tier"
    options = ["--port", str(port), "--memory-mib", str(KV_TIER_MEMORY_MIB), "--disk-dir", str(disk)]
    stack._spawn(KV_TIER_NAME, ["kv-tier", *options, "--disk-mib", str(KV_TIER_DISK_MIB)])
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if stack.processes[KV_TIER_NAME].poll() is not None:
                raise StackError(f"the KV tier stopped at start; see {stack.log_path(KV_TIER_NAME)}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == SERVING:
                    _say(f"      kv-tier  the shared KV tier at 127.0.0.1:{port}, spilling to {disk}/")
                    return ("--kv-tier", f"127.0.0.1:{port}")
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise StackError(f"the KV tier did not serve within {timeout:.0f} s; see {stack.log_path(KV_TIER_NAME)}")


def _demo_request(api_key: str, base_url: str, worker_names: dict[str, str]) -> None:
    import diptych

    with diptych.Client(api_key=api_key, base_url=base_url) as client:
        _say(f"      prompt: {DEMO_PROMPT!r}  (diptych-tiny has seeded random weights: expect gibberish)")
        _say("      output: ", end="")
        with client.completions.create(
            model="diptych-tiny", prompt=DEMO_PROMPT, max_tokens=32, temperature=0.0, stream=True
        ) as stream:
            for chunk in stream:
                _say(chunk.text, end="")
            usage = stream.usage
    _say()
    if usage is None or usage.prefill is None or usage.decode is None:
        raise StackError(f"the demo request's usage does not report both phases: {usage}")
    prefill = worker_names.get(usage.prefill.worker_id, usage.prefill.worker_id)
    decode = worker_names.get(usage.decode.worker_id, usage.decode.worker_id)
    if usage.prefill.worker_id == usage.decode.worker_id:
        where = f"both phases on {decode}: a prompt this short skips the KV hand-off"
    else:
        where = f"prefill on {prefill}, {usage.prefill.kv_bytes} KV bytes sent to decode on {decode}"
    _say(f"      usage: {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} completion tokens ({where})")


def _wait_for_interrupt(stack: Stack) -> None:
    while True:
        for name, process in stack.processes.items():
            if process.poll() is not None:
                raise StackError(f"{name} stopped unexpectedly; see {stack.log_path(name)}")
        time.sleep(0.5)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _step(number: int, text: str) -> None:
    _say(f"[{number}/5] {text}")


def _say(text: str = "", end: str = "\n") -> None:
    """Prints, unless nobody reads any more (the terminal or pipe is gone): then the rest of the output goes
    to /dev/null, so that neither the shutdown nor the interpreter's last flush fails on it."""
    try:
        print(text, end=end, flush=True)
    except OSError:  # EPIPE from a closed pipe, EIO from a hung-up terminal
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
