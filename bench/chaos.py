"""A bounded chaos run: `python -m bench.chaos --duration 60` (see docs/benchmarks.md, "Chaos run").

Starts the control plane, its jobs process (the Celery worker that runs batches), 2 prefill + 2 decode
workers of `diptych-tiny` and one split gateway on loopback, with two organizations that each stream
completions from a few concurrent clients and submit Batch API work now and then, cancelling some of it
(`bench.chaos_batches`). Every few seconds a random victim (a prefill worker, a decode worker, the
gateway, the control plane or the jobs process) is killed with SIGKILL and restarted after a short random
pause; the gateway keeps its state directory (its usage spool) across restarts. When the load has
stopped, every process is back, every batch has ended and the gateway's usage has drained to the control
plane, the ledger is read and compared, request id by request id, with what the clients received
(`bench.chaos_ledger`), and line by line with what the batches' output and error files report
(`bench.chaos_ledger_batches`). Exits with status 1 when usage was lost, doubled, billed to the wrong
organization, key or tier, or billed for a batch line reported as not run.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import chaos_batches
from bench.chaos_batches import BatchSettings, BatchTraffic
from bench.chaos_ledger import LedgerEvent, Reconciliation, RequestRecord, reconcile
from bench.chaos_ledger_batches import BatchReconciliation, reconcile_batches
from bench.workload import FIRST_ORDINARY_TOKEN
from diptych_common.builtin import DIPTYCH_TINY
from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from diptych_server.stack import REPO_ROOT, UNLIMITED_NEW_ORGANIZATIONS, Stack, StackError, free_port

VICTIM_KINDS = ("prefill", "decode", "gateway", "control-plane", "jobs")
GATEWAY, CONTROL_PLANE, JOBS = "gateway", "control-plane", "jobs"
# The jobs process's batch runner: two lines of a batch at a time, and a lease short enough that a batch
# whose runner was killed resumes within seconds (the defaults, 30 s and 10 s, would outlast the run).
JOBS_ENV = {
    "DIPTYCH_BATCH_MAX_CONCURRENT_LINES": "2",
    "DIPTYCH_BATCH_LEASE_SECONDS": "3",
    "DIPTYCH_BATCH_RESUME_SECONDS": "1",
    "DIPTYCH_BATCH_SLICE_SECONDS": "5",
}
JOBS_READY = " ready."  # Celery's worker logs "celery@<host> ready." once it consumes tasks
MODEL = "diptych-tiny"
SECOND_ORGANIZATION = ("Chaos B", "chaos-b")
READY_TIMEOUT_S = 180.0
POLL_S = 0.25
ERROR_BACKOFF_S = 0.25  # a client whose request failed before any token waits this long
DRAIN_STABLE_POLLS = 3  # the ledger unchanged for this many polls, one a second, with nothing spooled
ERROR_MESSAGE_CHARS = 160
TOP_ERROR_MESSAGES = 6
# The clients reconnect to a restarted gateway within a second, as a well-configured client would; gRPC's
# default backoff grows to two minutes, which would measure the client's patience, not the platform.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
SPOOLED_METRIC = "diptych_gateway_usage_events_spooled"
_started = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _started:7.1f} s] {message}", file=sys.stderr, flush=True)


# --- the platform -------------------------------------------------------------------------------------


@dataclass
class ChaosPlatform:
    stack: Stack
    api_keys: dict[str, str]  # organization id -> API key
    gateway_port: int
    metrics_url: str
    workers: dict[str, list[str]]  # role -> worker names
    http_port: int = 0
    _replaced_ids: dict[str, str] = field(default_factory=dict)  # killed worker -> its registry id
    _jobs_log_offset: int = 0  # the jobs log's size when the jobs process was last killed

    @property
    def gateway_http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"

    def names(self, kind: str) -> list[str]:
        return self.workers.get(kind) or [kind]

    def all_names(self) -> list[str]:
        jobs = [JOBS] if JOBS in self.stack.launches else []
        return [CONTROL_PLANE, *(n for names in self.workers.values() for n in names), GATEWAY, *jobs]

    def kill(self, name: str) -> None:
        if self._is_worker(name):
            self._replaced_ids[name] = self._registered_id(name)
        if name == JOBS:
            self._jobs_log_offset = self._jobs_log_size()
        self.stack.kill_process(name)

    def restart(self, name: str) -> None:
        """Starts the process again as it was started and waits until it serves."""
        self.stack.restart_process(name)
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = {CONTROL_PLANE: self._control_plane_ready, GATEWAY: self._gateway_ready, JOBS: self._jobs_ready}.get(
            name
        )
        while time.monotonic() < deadline:
            self._check_running(name)
            if ready() if ready else self._worker_registered_anew(name):
                return
            time.sleep(POLL_S)
        raise StackError(f"{name} did not serve again within {READY_TIMEOUT_S:.0f} s; see {self.stack.log_path(name)}")

    def revive_exited(self) -> list[str]:
        """Restarts every process that exited although nobody killed it; returns 'name (status)' of each."""
        exited = []
        for name in self.all_names():
            process = self.stack.processes.get(name)
            if process is not None and process.poll() is not None:
                exited.append(f"{name} (status {process.returncode})")
                log(f"{name} exited by itself with status {process.returncode}; restarting it")
                self.stack.processes.pop(name)
                if name == JOBS:
                    self._jobs_log_offset = self._jobs_log_size()
                self.restart(name)
        return exited

    def stop(self) -> None:
        """The gateway first, the workers side by side (each may take its grace period to drain), then the
        control plane and anything else `Stack.stop` knows."""
        if GATEWAY in self.stack.processes:
            self.stack.stop_process(GATEWAY)
        workers = [name for names in self.workers.values() for name in names if name in self.stack.processes]
        with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
            list(pool.map(self.stack.stop_process, workers))
        self.stack.stop()

    def wait_for_jobs(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._jobs_ready():
            self._check_running(JOBS)
            if time.monotonic() > deadline:
                raise StackError(f"the jobs process did not start; see {self.stack.log_path(JOBS)}")
            time.sleep(POLL_S)

    def _is_worker(self, name: str) -> bool:
        return name not in (GATEWAY, CONTROL_PLANE, JOBS)

    def _jobs_log_size(self) -> int:
        path = self.stack.log_path(JOBS)
        return path.stat().st_size if path.exists() else 0

    def _jobs_ready(self) -> bool:
        """The restarted jobs process's Celery worker consumes tasks (its log since the kill says so)."""
        with open(self.stack.log_path(JOBS), "rb") as jobs_log:
            jobs_log.seek(self._jobs_log_offset)
            return JOBS_READY.encode() in jobs_log.read()

    def _check_running(self, name: str) -> None:
        code = self.stack.processes[name].poll()
        if code is not None:
            tail = self.stack.log_path(name).read_text(errors="replace")[-2000:]
            raise StackError(f"{name} exited with status {code} while restarting:\n{tail}")

    def _registry_workers(self) -> list[dict]:
        try:
            response = self.stack.registry()
        except httpx.TransportError:
            return []
        return response.json()["workers"] if response.status_code == 200 else []

    def _registered_id(self, name: str) -> str:
        return next((w["id"] for w in self._registry_workers() if w["name"] == name), "")

    def _worker_registered_anew(self, name: str) -> bool:
        old_id = self._replaced_ids.get(name, "")
        return any(w["name"] == name and w["state"] == "ready" and w["id"] != old_id for w in self._registry_workers())

    def _control_plane_ready(self) -> bool:
        try:
            return self.stack.registry().status_code == 200
        except httpx.TransportError:
            return False

    def _gateway_ready(self) -> bool:
        with grpc.insecure_channel(self.gateway_address) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING


KV_PATH_WORKER_ARGS = {
    "shm": (),
    "nixl": ("--no-kv-shm", "--kv-nixl", "on"),
    "tcp": ("--no-kv-shm", "--kv-nixl", "off"),
}


def start_platform(
    state_dir: Path, prefill_workers: int, decode_workers: int, jobs: bool, kv_path: str = "shm"
) -> ChaosPlatform:
    stack = Stack(
        state_dir,
        control_plane_port=free_port(),
        database_url=f"sqlite:///{state_dir / 'cp.sqlite3'}",
        extra_env=UNLIMITED_NEW_ORGANIZATIONS,
    )
    try:
        log("migrating the control plane's database; issuing the first organization's key")
        credentials = stack.prepare_control_plane(demo=True)
        second_id, second_key = create_organization(stack, *SECOND_ORGANIZATION)
        api_keys = {credentials.organization_id: credentials.api_key, second_id: second_key}
        log(f"starting the control plane on {stack.control_plane_url}")
        stack.start_control_plane()
        workers = {
            "prefill": [f"prefill-{i}" for i in range(prefill_workers)],
            "decode": [f"decode-{i}" for i in range(decode_workers)],
        }
        for role, names in workers.items():
            for name in names:
                stack.start_worker(
                    name, role, credentials.fleet_tokens[role], free_port(), *KV_PATH_WORKER_ARGS[kv_path]
                )
        port, metrics_port, http_port = free_port(), free_port(), free_port()
        log(
            f"starting the gateway on 127.0.0.1:{port} (its usage spool under {state_dir / 'gateway'}) while "
            f"{prefill_workers} prefill and {decode_workers} decode workers load the model"
        )
        # Every request takes the split path, so that killing a prefill worker always hits something.
        stack.start_gateway(
            GATEWAY,
            port,
            metrics_port,
            "split",
            http_port=http_port,
            timeout=READY_TIMEOUT_S,
            extra=(
                "--state-dir",
                str(state_dir / "gateway"),
                "--skip-split-below",
                "0",
                "--prefill-overflow-tokens",
                "0",
            ),
        )
        platform = ChaosPlatform(stack, api_keys, port, f"http://127.0.0.1:{metrics_port}/metrics", workers, http_port)
        if jobs:
            log("starting the jobs process (batches run through the gateway's HTTP API)")
            stack.start_jobs(DIPTYCH_GATEWAY_URL=platform.gateway_http_url, **JOBS_ENV)
        stack.wait_for_workers([n for names in workers.values() for n in names], timeout=READY_TIMEOUT_S)
        if jobs:
            platform.wait_for_jobs()
    except BaseException:
        stack.stop()
        raise
    return platform


CREATE_ORGANIZATION = """
import json
from controlplane.tenancy.models import Scope
from controlplane.tenancy.services import api_key_create, organization_ensure
organization = organization_ensure(name={name!r}, slug={slug!r})
issued = api_key_create(organization=organization, name="chaos", scopes=Scope.values)
print(json.dumps({{"organization_id": organization.public_id, "api_key": issued.key}}))
"""

READ_LEDGER = """
import json
from controlplane.metering.models import UsageEvent
rows = UsageEvent.objects.values_list(
    "request_id", "phase", "organization__public_id", "tokens", "api_key__public_id", "tier", "client_request_id"
)
print(json.dumps([list(row) for row in rows]))
"""

READ_RUNNER_KEYS = """
import json
from controlplane.batches.models import Batch
print(json.dumps(dict(Batch.objects.values_list("public_id", "runner_key__public_id"))))
"""


def create_organization(stack: Stack, name: str, slug: str) -> tuple[str, str]:
    """A second organization with an API key of its own: (organization id, key)."""
    created = json.loads(django_shell(stack, CREATE_ORGANIZATION.format(name=name, slug=slug)))
    return created["organization_id"], created["api_key"]


def read_ledger(stack: Stack) -> list[LedgerEvent]:
    """Every usage event in the control plane's database, whichever organization it is billed to."""
    return [LedgerEvent(*row) for row in json.loads(django_shell(stack, READ_LEDGER))]


def read_runner_keys(stack: Stack) -> dict[str, str]:
    """Batch id -> the public id of its runner key, for every batch."""
    return json.loads(django_shell(stack, READ_RUNNER_KEYS))


def django_shell(stack: Stack, code: str) -> str:
    """Runs code in the control plane's Django environment; returns the last line it printed."""
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=REPO_ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise StackError(f"manage.py shell failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


# --- the load -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSettings:
    clients_per_organization: int
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    request_timeout_s: float


class Load:
    """Concurrent streaming clients per organization, each sending its next request when the last ended."""

    def __init__(self, platform: ChaosPlatform, settings: LoadSettings, seed: int) -> None:
        self._platform = platform
        self._settings = settings
        self._seed = seed
        self.records: list[RequestRecord] = []
        self.error_messages: Counter[str] = Counter()  # "CODE: details" -> requests
        self.started = time.monotonic()
        self.seconds = 0.0  # how long the load ran, the tail after the last restart included
        self.until = self.started  # clients send while the clock is before this; the chaos may extend it

    async def warm_up(self, timeout_s: float) -> None:
        """One completed request per organization before the clock starts: the gateway has seen the workers
        and every key works. These requests are recorded and reconciled like the others."""
        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(self._platform.gateway_address, options=CHANNEL_OPTIONS) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            rng = random.Random(f"{self._seed}:warm-up")
            for organization_id, api_key in self._platform.api_keys.items():
                while not (await self._one_request(stub, organization_id, api_key, rng)).completed:
                    if time.monotonic() > deadline:
                        raise StackError(
                            f"no request of {organization_id} completed within {timeout_s:.0f} s: "
                            f"{dict(self.error_messages.most_common(3))}"
                        )
                    await asyncio.sleep(ERROR_BACKOFF_S)

    async def run(self, duration_s: float) -> None:
        now = time.monotonic()
        for record in self.records:  # the warm-up's, before the clock starts: negative times
            record.sent_at_s -= now - self.started
        self.started = now
        self.until = self.started + duration_s
        async with grpc.aio.insecure_channel(self._platform.gateway_address, options=CHANNEL_OPTIONS) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            clients = [
                self._client(stub, organization_id, api_key, random.Random(f"{self._seed}:{organization_id}:{i}"))
                for organization_id, api_key in self._platform.api_keys.items()
                for i in range(self._settings.clients_per_organization)
            ]
            await asyncio.gather(*clients)
        self.seconds = time.monotonic() - self.started

    async def _client(self, stub, organization_id: str, api_key: str, rng: random.Random) -> None:
        while time.monotonic() < self.until:
            record = await self._one_request(stub, organization_id, api_key, rng)
            if not record.completed and record.delivered_tokens == 0:
                await asyncio.sleep(ERROR_BACKOFF_S)

    async def _one_request(self, stub, organization_id: str, api_key: str, rng: random.Random) -> RequestRecord:
        prompt = [
            rng.randrange(FIRST_ORDINARY_TOKEN, DIPTYCH_TINY.llama_config["vocab_size"])
            for _ in range(rng.randint(*self._settings.prompt_tokens))
        ]
        request = inference_pb2.GenerateRequest(
            model=MODEL,
            prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
            max_tokens=rng.randint(*self._settings.max_tokens),
            temperature=0.0,
            ignore_eos=True,
        )
        record = RequestRecord(organization_id, len(prompt), time.monotonic() - self.started)
        self.records.append(record)
        call = stub.Generate(
            request, metadata=(("authorization", f"Bearer {api_key}"),), timeout=self._settings.request_timeout_s
        )
        try:
            async for message in call:
                record.request_id = record.request_id or message.request_id
                record.delivered_tokens += len(message.token_ids)
                if message.HasField("usage"):
                    record.usage_completion_tokens = message.usage.completion_tokens
            record.completed = True
        except grpc.aio.AioRpcError as error:
            record.error = error.code().name
            self.error_messages[f"{record.error}: {(error.details() or '')[:ERROR_MESSAGE_CHARS]}"] += 1
            record.request_id = record.request_id or _metadata_request_id(error.trailing_metadata())
        return record


def _metadata_request_id(metadata) -> str:
    return next((value for key, value in (metadata or ()) if key == "request-id"), "")


# --- the chaos ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosSettings:
    victims: tuple[str, ...]
    interval_s: tuple[float, float]  # between one victim's return and the next kill
    down_s: tuple[float, float]  # between a kill and the restart
    max_kills: int | None


@dataclass
class Kill:
    name: str
    kind: str
    killed_at_s: float
    back_at_s: float = 0.0


class Chaos:
    """Kills one process at a time and brings it back before choosing the next."""

    def __init__(self, platform: ChaosPlatform, settings: ChaosSettings, seed: int) -> None:
        self._platform = platform
        self._settings = settings
        self._rng = random.Random(seed)
        self.kills: list[Kill] = []
        self.exited_by_themselves: list[str] = []

    async def run(self, load: Load, duration_s: float, tail_s: float) -> None:
        """Kills until `duration_s` into the load; keeps the load running `tail_s` after each return."""
        until = load.started + duration_s
        while self._settings.max_kills is None or len(self.kills) < self._settings.max_kills:
            pause = self._rng.uniform(*self._settings.interval_s)
            if time.monotonic() + pause >= until:
                return
            await asyncio.sleep(pause)
            load.until = math.inf  # the load goes on while a victim is down, whatever the clock says
            try:
                self.exited_by_themselves += await asyncio.to_thread(self._platform.revive_exited)
                await self._kill_one(load.started)
            finally:
                load.until = max(until, time.monotonic() + tail_s)

    async def _kill_one(self, started: float) -> None:
        kind = self._rng.choice(self._settings.victims)
        name = self._rng.choice(self._platform.names(kind))
        down = self._rng.uniform(*self._settings.down_s)
        kill = Kill(name, kind, time.monotonic() - started)
        self.kills.append(kill)
        log(f"SIGKILL {name}; restarting it in {down:.1f} s")
        await asyncio.to_thread(self._platform.kill, name)
        await asyncio.sleep(down)
        await asyncio.to_thread(self._platform.restart, name)
        kill.back_at_s = time.monotonic() - started
        log(f"{name} serves again, {kill.back_at_s - kill.killed_at_s:.1f} s after its kill")

    def kills_by_kind(self) -> dict[str, int]:
        counts = Counter(k.kind for k in self.kills)
        return {kind: counts[kind] for kind in VICTIM_KINDS}


async def report_progress(load: Load, chaos: Chaos, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        records = load.records
        log(
            f"load: {len(records)} sent, {sum(r.completed for r in records)} completed, "
            f"{sum(bool(r.error) for r in records)} errored, {sum(r.delivered_tokens for r in records)} tokens; "
            f"{len(chaos.kills)} kill(s)"
        )


async def run_load_under_chaos(platform: ChaosPlatform, args) -> tuple[Load, Chaos, BatchTraffic | None]:
    load = Load(
        platform,
        LoadSettings(args.clients_per_org, tuple(args.prompt_tokens), tuple(args.max_tokens), args.request_timeout),
        args.seed,
    )
    chaos = Chaos(
        platform,
        ChaosSettings(tuple(args.victims), tuple(args.kill_interval), tuple(args.down_time), args.max_kills),
        args.seed,
    )
    log("warming up: one completed request per organization")
    await load.warm_up(READY_TIMEOUT_S)
    log(
        f"load for {args.duration:g} s: {args.clients_per_org} streaming client(s) per organization; "
        f"victims {', '.join(args.victims)}"
    )
    traffic = None
    if args.batches:
        settings = BatchSettings(
            tuple(args.batch_every),
            tuple(args.batch_lines),
            tuple(args.batch_max_tokens),
            args.cancel_share,
            (1.0, 6.0),
        )
        traffic = BatchTraffic(platform.gateway_http_url, platform.api_keys, settings, args.seed)
        log(
            f"and a batch of {args.batch_lines[0]}-{args.batch_lines[1]} lines per organization every "
            f"{args.batch_every[0]:g}-{args.batch_every[1]:g} s"
        )
    progress = asyncio.create_task(report_progress(load, chaos, args.progress_every))
    load_task = asyncio.create_task(load.run(args.duration))
    await asyncio.sleep(0)  # lets the load stamp its start before the chaos reads it
    tasks = [load_task, chaos.run(load, args.duration, args.tail)]
    if traffic is not None:
        tasks.append(traffic.run(lambda: time.monotonic() < load.until))
    try:
        await asyncio.gather(*tasks)
    finally:
        progress.cancel()
    log("load stopped; every victim is back")
    if traffic is not None:
        cancelled = sum(bool(b.cancel) for b in traffic.submitted)
        log(
            f"{len(traffic.submitted)} batch(es) submitted, {cancelled} cancelled; "
            f"calls retried: {dict(traffic.retried_calls)}"
        )
    for message, count in load.error_messages.most_common(TOP_ERROR_MESSAGES):
        log(f"{count} x {message}")
    chaos.exited_by_themselves += await asyncio.to_thread(platform.revive_exited)
    return load, chaos, traffic


# --- after the load -----------------------------------------------------------------------------------


def wait_for_usage_drained(platform: ChaosPlatform, timeout_s: float) -> bool:
    """True once the gateway's spool is empty and the ledger's totals stayed the same for a few seconds."""
    deadline = time.monotonic() + timeout_s
    previous, stable = None, 0
    while time.monotonic() < deadline:
        totals = _ledger_totals(platform)
        spooled = _gateway_metric(platform.metrics_url, SPOOLED_METRIC)
        stable = stable + 1 if totals is not None and totals == previous and spooled == 0 else 0
        if stable >= DRAIN_STABLE_POLLS:
            return True
        previous = totals
        time.sleep(1.0)
    return False


def _ledger_totals(platform: ChaosPlatform) -> tuple | None:
    """(events, tokens) per organization and phase, through each organization's usage summary."""
    totals = []
    for organization_id, api_key in sorted(platform.api_keys.items()):
        try:
            response = httpx.get(
                f"{platform.stack.control_plane_url}/api/v1/usage/summary",
                headers={"Authorization": f"Bearer {api_key}"},
                timeout=5.0,
            )
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        totals += [(organization_id, row["phase"], row["requests"], row["tokens"]) for row in response.json()["data"]]
    return tuple(totals)


def _gateway_metric(url: str, name: str) -> float | None:
    """The metric's value; 0 when the gateway does not export it (the ledger's stability then decides
    alone), None when its metrics page does not answer."""
    try:
        text = httpx.get(url, timeout=5.0).text
    except httpx.TransportError:
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)


@dataclass
class ChaosReport:
    duration_s: float
    load_s: float
    organizations: int
    kills: dict[str, int]
    timeline: list[dict]
    exited_by_themselves: list[str]
    error_messages: dict[str, int]  # the most frequent "CODE: details" the clients got
    drained: bool
    completed_after_last_restart: int | None
    ledger: Reconciliation
    batches: BatchReconciliation | None = None
    batches_submitted: int = 0  # create calls that were answered or retried (a lost answer may still create one)
    batches_cancelled: dict[str, int] = field(default_factory=dict)  # the cancel call's outcome -> batches
    batch_calls_retried: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.ledger.failed or (self.batches is not None and self.batches.failed)


def build_report(
    args,
    load: Load,
    chaos: Chaos,
    drained: bool,
    events: list[LedgerEvent],
    traffic: BatchTraffic | None = None,
    batches: list[chaos_batches.BatchRecord] | None = None,
) -> ChaosReport:
    batch_ledger, batch_ids = reconcile_batches(batches, events) if batches is not None else (None, set())
    interactive_events = [e for e in events if e.request_id not in batch_ids]
    last_back = max((k.back_at_s for k in chaos.kills), default=None)
    after = None if last_back is None else sum(r.completed and r.sent_at_s >= last_back for r in load.records)
    return ChaosReport(
        duration_s=args.duration,
        load_s=round(load.seconds, 1),
        organizations=len({r.organization_id for r in load.records}),
        kills=chaos.kills_by_kind(),
        timeline=[dataclasses.asdict(k) for k in chaos.kills],
        exited_by_themselves=chaos.exited_by_themselves,
        error_messages=dict(load.error_messages.most_common(TOP_ERROR_MESSAGES)),
        drained=drained,
        completed_after_last_restart=after,
        ledger=reconcile(load.records, interactive_events),
        batches=batch_ledger,
        batches_submitted=len(traffic.submitted) if traffic else 0,
        batches_cancelled=dict(Counter(b.cancel.split(":")[0] for b in traffic.submitted if b.cancel))
        if traffic
        else {},
        batch_calls_retried=dict(traffic.retried_calls) if traffic else {},
    )


def render(report: ChaosReport) -> str:
    ledger = report.ledger
    rows = [
        ("requests sent", ledger.requests_sent),
        ("completed", ledger.completed),
        ("errored (before any token)", f"{ledger.errored} ({ledger.errored_before_any_token})"),
        ("errors by code", ", ".join(f"{code} {n}" for code, n in ledger.errors_by_code.items()) or "none"),
        ("delivered tokens", ledger.delivered_tokens),
        ("ledger events", ledger.ledger_events),
        ("billed input tokens", ledger.billed_input_tokens),
        ("billed output tokens", ledger.billed_output_tokens),
        (
            "**lost** (output tokens; missing prefill)",
            f"{ledger.lost} ({ledger.lost_output_tokens}; {ledger.missing_prefill})",
        ),
        ("**doubled** (request ids shared)", f"{ledger.doubled} ({ledger.shared_request_ids})"),
        ("overbilled", ledger.overbilled),
        (
            "overbilled by (extra tokens: requests)",
            ", ".join(f"+{extra}: {n}" for extra, n in sorted(ledger.overbilled_distribution.items())) or "none",
        ),
        ("**misattributed**", ledger.misattributed),
        ("unknown events (their output tokens)", f"{ledger.unknown_events} ({ledger.unknown_output_tokens})"),
        ("prefill events not billing the prompt sent", ledger.prefill_tokens_mismatch),
        ("completed streams whose usage disagrees", ledger.usage_mismatch),
        ("kills per victim kind", ", ".join(f"{kind} {n}" for kind, n in report.kills.items())),
        ("processes that exited by themselves", ", ".join(report.exited_by_themselves) or "none"),
        ("requests completed after the last restart", report.completed_after_last_restart),
        ("usage drained before the ledger was read", "yes" if report.drained else "**no**"),
    ]
    title = (
        f"## Chaos run: {report.load_s:g} s of load ({report.duration_s:g} s of kills) from "
        f"{report.organizations} organizations"
    )
    lines = [title, "", "| figure | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    if report.batches is not None:
        lines += ["", "Batch API traffic:", "", "| figure | value |", "| --- | --- |"]
        lines += [f"| {name} | {value} |" for name, value in _batch_rows(report)]
    if report.failed:
        verdict = "FAILED: usage lost, doubled, misattributed or billed but not reported"
    else:
        verdict = "every delivered token billed once"
        verdict += "" if report.batches is None else ", every answered batch line billed once and no other"
    return "\n".join(lines + ["", f"Verdict: {verdict}."])


def _batch_rows(report: ChaosReport) -> list[tuple[str, object]]:
    batches = report.batches
    assert batches is not None
    not_run = ", ".join(f"{code} {n}" for code, n in sorted(batches.not_run.items())) or "none"
    return [
        ("batches submitted / on the control plane", f"{report.batches_submitted} / {batches.batches}"),
        ("batches by status", ", ".join(f"{status} {n}" for status, n in batches.batches_by_status.items()) or "none"),
        (
            "cancel calls (the batch's status after)",
            ", ".join(f"{s} {n}" for s, n in report.batches_cancelled.items()) or "none",
        ),
        ("Batch API calls retried", ", ".join(f"{c} x{n}" for c, n in report.batch_calls_retried.items()) or "none"),
        ("lines", batches.lines),
        ("answered (output file)", batches.answered),
        ("refused (error file, with an answer)", batches.refused),
        ("not run (error file, by code)", not_run),
        ("billed executions (ledger events)", f"{batches.billed_executions} ({batches.ledger_events})"),
        ("billed input / output tokens", f"{batches.billed_input_tokens} / {batches.billed_output_tokens}"),
        ("**lost**", batches.lost),
        ("**doubled**", batches.doubled),
        ("**misattributed** (organization, key or tier)", batches.misattributed),
        (
            "**billed but not reported** (executions no line names)",
            f"{batches.billed_not_reported} ({batches.unclaimed_executions})",
        ),
        ("**batches not ended**", batches.unended),
        ("lines in neither file; reported twice", f"{batches.absent}; {batches.reported_twice}"),
        ("batches whose request_counts disagree with their files", batches.counts_disagree),
        ("answered lines billed more output than answered", batches.overbilled),
    ]


def run(args) -> int:
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="diptych-chaos-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    keep_state = args.state_dir is not None
    platform = start_platform(
        state_dir, args.prefill_workers, args.decode_workers, args.batches or JOBS in args.victims, args.kv_path
    )
    try:
        load, chaos, traffic = asyncio.run(run_load_under_chaos(platform, args))
        if traffic is not None:
            log(f"waiting up to {args.batch_timeout:g} s for every batch to end")
            unended = chaos_batches.wait_until_ended(
                platform.stack.control_plane_url, platform.api_keys, args.batch_timeout
            )
            log(f"batches still running: {', '.join(unended)}" if unended else "every batch has ended")
        log(f"waiting up to {args.drain_timeout:g} s for the gateway's usage to reach the ledger")
        drained = wait_for_usage_drained(platform, args.drain_timeout)
        log("reading the ledger" + (" and every batch's files" if traffic is not None else ""))
        events = read_ledger(platform.stack)
        batches = None
        if traffic is not None:
            runner_keys = read_runner_keys(platform.stack)
            batches = chaos_batches.collect(platform.stack.control_plane_url, platform.api_keys, runner_keys)
        report = build_report(args, load, chaos, drained, events, traffic, batches)
    except BaseException:
        keep_state = True
        raise
    finally:
        log("stopping every process")
        platform.stop()
        if keep_state:
            log(f"logs and databases kept in {state_dir}")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
    print(render(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=1))
        log(f"results written to {args.json}")
    return 1 if report.failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM ends the run as Ctrl-C does: through the `finally` that stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
