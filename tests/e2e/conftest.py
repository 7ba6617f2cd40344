"""A live platform for the end-to-end tests: the control plane on its own database, a prefill, a decode
and a colocated worker, and two gateways (one routing split, one colocated), all real processes."""

import json
import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import psycopg
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from diptych_server.stack import REPO_ROOT as STACK_REPO_ROOT
from diptych_server.stack import Credentials, Stack, free_port
from tests.e2e.waiting import wait_for

# How long a cancelled request may take to leave every worker: far less than its tokens take to decode.
CANCEL_WINDOW_S = 5.0


@dataclass
class LiveStack:
    stack: Stack
    credentials: Credentials
    gateways: dict[str, str]  # mode -> grpc:// base URL
    metrics_urls: dict[str, str]  # mode -> Prometheus URL
    workers: dict[str, dict]  # name -> registry entry
    http_urls: dict[str, str] = field(default_factory=dict)  # mode -> OpenAI-compatible base URL (…/v1)
    worker_metrics_urls: dict[str, str] = field(default_factory=dict)  # worker name -> Prometheus URL

    @property
    def api_key(self) -> str:
        return self.credentials.api_key

    def rest(self, api_key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.stack.control_plane_url}/api/v1",
            headers={"Authorization": f"Bearer {api_key or self.api_key}"},
            timeout=10.0,
        )

    def internal(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.stack.control_plane_url}/api/v1/internal",
            headers={"Authorization": f"Bearer {self.stack.internal_token}"},
            timeout=10.0,
        )

    def worker_load(self, name: str) -> worker_pb2.Load:
        return worker_load(self.stack, self.workers[name]["address"])

    def watch_cancellation(self, max_tokens: int) -> "CancellationWatch":
        return CancellationWatch(self.stack, self.workers, self.worker_metrics_urls, max_tokens)

    def wait_until_usage_sent(self, mode: str, seconds: float = 15.0) -> None:
        """Returns once the gateway's outbox is empty: the control plane acknowledged every usage event it had."""
        sent = wait_for(lambda: self.gateway_metric(mode, "diptych_gateway_usage_events_spooled") == 0, seconds)
        assert sent, f"the {mode} gateway still holds usage events after {seconds} s"

    def gateway_metric(self, mode: str, name: str) -> float:
        text = httpx.get(self.metrics_urls[mode], timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def worker_load(stack: Stack, address: str) -> worker_pb2.Load:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(
            worker_pb2.LoadRequest(), timeout=5, metadata=worker_credential(stack)
        )


def tokens_computed(metrics_url: str) -> float:
    """Tokens a worker's engine has computed since it started (prompt chunks and decoded tokens)."""
    text = httpx.get(metrics_url, timeout=5).text
    lines = text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("diptych_worker_step_tokens_sum"))


class CancellationWatch:
    """Made before a request the test will cancel; `assert_freed` then checks that the workers dropped it:
    within CANCEL_WINDOW_S no worker runs or queues a sequence or holds a KV block, and the
    workers computed far fewer tokens than the request asked for (one that kept decoding it to the end would
    have computed about `max_tokens`, however fast it ran)."""

    def __init__(self, stack: Stack, workers: dict[str, dict], metrics_urls: dict[str, str], max_tokens: int):
        assert set(metrics_urls) == set(workers), "every watched worker needs a metrics port"
        self._stack, self._workers, self._metrics_urls = stack, dict(workers), metrics_urls
        self.max_tokens = max_tokens
        self._computed_before = self._computed()

    def _computed(self) -> float:
        return sum(tokens_computed(self._metrics_urls[name]) for name in self._workers)

    def busy(self) -> dict[str, tuple[int, int, int]]:
        """Workers still holding work: (running, waiting, KV blocks in use) by name."""
        loads = {name: worker_load(self._stack, worker["address"]) for name, worker in self._workers.items()}
        return {
            name: (load.active_sequences, load.queue_depth, load.kv_blocks_total - load.kv_blocks_free)
            for name, load in loads.items()
            if load.active_sequences or load.queue_depth or load.kv_blocks_free != load.kv_blocks_total
        }

    def assert_freed(self, prompt_tokens: int = 0) -> None:
        freed = wait_for(lambda: not self.busy(), seconds=CANCEL_WINDOW_S, interval=0.05)
        assert freed, f"{CANCEL_WINDOW_S} s after the cancel, still busy (running, waiting, blocks): {self.busy()}"
        computed = self._computed() - self._computed_before - prompt_tokens
        assert computed < self.max_tokens / 2, (
            f"the workers computed {computed:.0f} tokens of a request cancelled early (max_tokens {self.max_tokens})"
        )


def worker_credential(stack: Stack) -> tuple[tuple[str, str], ...]:
    """The metadata a call to a worker needs: the worker RPC secret, as the gateway gets it."""
    response = httpx.get(
        f"{stack.control_plane_url}/api/v1/internal/worker-credential",
        headers={"Authorization": f"Bearer {stack.internal_token}"},
        timeout=5.0,
    )
    response.raise_for_status()
    return (("authorization", f"Bearer {response.json()['worker_rpc_secret']}"),)


@contextmanager
def own_database(directory):
    """A database of its own: PostgreSQL when DATABASE_URL names one, else a SQLite file in `directory`."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        yield f"sqlite:///{directory / 'controlplane.sqlite3'}"
        return
    server, _, _ = url.rpartition("/")
    name = f"diptych_e2e_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{server}/{name}"
    finally:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def e2e_database_url(tmp_path_factory):
    with own_database(tmp_path_factory.mktemp("db")) as url:
        yield url


@pytest.fixture(scope="session")
def live(tmp_path_factory, e2e_database_url):
    stack = Stack(tmp_path_factory.mktemp("stack"), control_plane_port=free_port(), database_url=e2e_database_url)
    try:
        credentials = stack.prepare_control_plane(demo=True)
        stack.start_control_plane()
        names = ["prefill-0", "decode-0", "colocated-0"]
        worker_metrics = {name: free_port() for name in names}
        for name in names:
            role = name.split("-")[0]
            stack.start_worker(
                name, role, credentials.fleet_tokens[role], free_port(), "--metrics-port", str(worker_metrics[name])
            )
        workers = dict(zip(names, stack.wait_for_workers(names), strict=True))
        gateways, metrics, http_urls = {}, {}, {}
        for mode in ("split", "colocated"):
            port, metrics_port, http_port = free_port(), free_port(), free_port()
            stack.start_gateway(f"gateway-{mode}", port, metrics_port, mode, http_port=http_port)
            gateways[mode] = f"grpc://127.0.0.1:{port}"
            metrics[mode] = f"http://127.0.0.1:{metrics_port}/metrics"
            http_urls[mode] = f"http://127.0.0.1:{http_port}/v1"
        worker_metrics_urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in worker_metrics.items()}
        yield LiveStack(stack, credentials, gateways, metrics, workers, http_urls, worker_metrics_urls)
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The built-in model as `diptych model save` writes it, loaded the way any user would load it."""
    directory = tmp_path_factory.mktemp("diptych-tiny")
    subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", "model", "save", "diptych-tiny", str(directory)], check=True
    )
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    return model, AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="session")
def control_plane_shell(live):
    """Runs Python code in the live control plane's Django environment (`manage.py shell -c`); returns its stdout.

    For what the tests cannot do through the API: a scheduled job run now, a dashboard password set.
    """

    def run(code: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=STACK_REPO_ROOT,
            env=live.stack.env(),
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise AssertionError(f"manage.py shell failed:\n{result.stderr[-3000:]}")
        return result.stdout

    return run


@pytest.fixture(scope="session")
def other_organization(control_plane_shell) -> dict:
    """A second organization with its own API key."""
    return new_organization(control_plane_shell)


def new_organization(control_plane_shell) -> dict:
    """A fresh organization with its own API key: its ledger holds only what a test sends with it."""
    slug = f"other-{uuid.uuid4().hex[:8]}"
    output = control_plane_shell(
        "import json\n"
        "from controlplane.tenancy.models import Scope\n"
        "from controlplane.tenancy.services import api_key_create, organization_ensure\n"
        f"organization = organization_ensure(name='Other', slug='{slug}')\n"
        "issued = api_key_create(organization=organization, name='other', scopes=Scope.values)\n"
        "print(json.dumps({'organization_id': organization.public_id, 'api_key': issued.key}))\n"
    )
    return json.loads(output.strip().splitlines()[-1])
