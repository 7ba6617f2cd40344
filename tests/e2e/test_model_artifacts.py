"""Model artifacts end to end: `diptych model save` then `diptych model register NAME DIR --revision R`
publishes the directory; a worker started with nothing but its fleet token fetches the files into its cache,
verified by sha256, and serves the same tokens as the model the files came from. A byte changed in the store
or in the cache stops a worker from starting; a new revision drains the old one's workers once a worker of
the new one is ready, while requests keep succeeding; and the same works with S3-compatible storage (moto's
server on loopback) as the store.
"""

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import diptych
from diptych_server.stack import Stack, free_port
from tests.e2e.conftest import own_database
from tests.e2e.test_generation import generate_reference
from tests.e2e.test_local_model_dir import diptych_command
from tests.e2e.waiting import wait_for

MODEL = "tiny-art"
PROMPT = "Published files, fetched and checked, serve the same tokens as the directory they came from."
MAX_TOKENS = 12
EXIT_WITHIN_S = 90.0  # a refusing worker exits before it loads anything
S3_BUCKET = "diptych-models"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Platform:
    stack: Stack
    api_key: str
    gateway: str  # grpc:// base URL of a colocated gateway


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """diptych-tiny as `diptych model save` writes it."""
    directory = tmp_path_factory.mktemp("saved") / "diptych-tiny"
    subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", "model", "save", "diptych-tiny", str(directory)], check=True
    )
    return directory


@pytest.fixture(scope="module")
def expected_tokens(saved) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    return generate_reference(model, AutoTokenizer.from_pretrained(saved)(PROMPT)["input_ids"], MAX_TOKENS)


@contextmanager
def start_platform(directory: Path, gateway_env: dict[str, str] | None = None, **extra_env: str):
    """A control plane and a colocated gateway of their own (own database, own state directory)."""
    with own_database(directory) as database_url:
        stack = Stack(directory / "state", free_port(), database_url=database_url, extra_env=extra_env)
        try:
            credentials = stack.prepare_control_plane(demo=True)
            stack.start_control_plane()
            gateway_port = free_port()
            stack.start_gateway(
                "gateway", gateway_port, free_port(), "colocated", http_port=free_port(), **(gateway_env or {})
            )
            yield Platform(stack, credentials.api_key, f"grpc://127.0.0.1:{gateway_port}")
        finally:
            stack.stop()


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    with start_platform(tmp_path_factory.mktemp("artifacts")) as started:
        yield started


@pytest.fixture(scope="module")
def published(platform, saved) -> dict:
    """`diptych model register tiny-art DIR --revision r1`: the fleet tokens and revision."""
    return json.loads(
        diptych_command(platform.stack, "model", "register", MODEL, str(saved), "--revision", "r1", "--json")
    )


@pytest.fixture(scope="module")
def first_worker(platform, published, tmp_path_factory) -> dict:
    """A colocated worker started with only its fleet token (and a cache of its own); its registry entry."""
    cache = tmp_path_factory.mktemp("cache-1")
    start_worker(platform.stack, "art-1", published["fleet_tokens"]["colocated"], cache)
    (entry,) = platform.stack.wait_for_workers(["art-1"])
    return entry | {"cache": cache}


def start_worker(stack: Stack, name: str, token: str, cache: Path) -> None:
    stack.start_worker(name, "colocated", token, free_port(), "--artifact-cache", str(cache))


def exit_status(stack: Stack, name: str) -> tuple[int, str]:
    """Waits for a worker that should refuse to start; its exit status and log."""
    code = stack.processes[name].wait(EXIT_WITHIN_S)
    stack.stop_process(name)
    return code, stack.log_path(name).read_text(errors="replace")


def complete(platform: Platform, model: str = MODEL):
    with diptych.Client(api_key=platform.api_key, base_url=platform.gateway) as client:
        assert wait_for(lambda: model in {m.id for m in client.models.list()}, 30), f"the gateway never listed {model}"
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)


def flip_one_byte(path: Path) -> tuple[str, str]:
    """Changes one byte in the middle of the file; its sha256 before and after."""
    data = bytearray(path.read_bytes())
    before = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return before, hashlib.sha256(data).hexdigest()


def registry_worker(stack: Stack, name: str) -> dict:
    return next(w for w in stack.registry().json()["workers"] if w["name"] == name)


def test_a_worker_with_only_its_fleet_token_fetches_the_published_files_and_serves_the_same_tokens(
    platform, saved, published, first_worker, expected_tokens
):
    assert published["revision"] == "r1"
    assert first_worker["revision"] == "r1"
    cached = first_worker["cache"] / MODEL / "r1"
    published_files = {p.relative_to(saved): p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    assert {p.relative_to(cached): p.read_bytes() for p in cached.rglob("*") if p.is_file()} == published_files
    log = platform.stack.log_path("art-1").read_text()
    assert f"{len(published_files)} file(s) fetched, 0 verified from the cache" in log

    completion = complete(platform)
    assert completion.token_ids == expected_tokens
    assert completion.usage.decode.worker_id == first_worker["id"]


def test_a_byte_changed_in_the_store_stops_a_fresh_worker_naming_the_file_and_both_digests(platform, saved, tmp_path):
    stack = platform.stack
    tokens = json.loads(
        diptych_command(stack, "model", "register", "tiny-bad", str(saved), "--revision", "r1", "--json")
    )
    expected, actual = flip_one_byte(stack.state_dir / "artifacts" / "tiny-bad" / "r1" / "model.safetensors")
    start_worker(stack, "bad-store", tokens["fleet_tokens"]["colocated"], tmp_path)
    code, log = exit_status(stack, "bad-store")
    assert code != 0
    assert (
        "the worker refuses to start: checksum mismatch for model.safetensors (as downloaded; not kept): "
        f"expected sha256 {expected}, got {actual}"
    ) in log
    assert not (tmp_path / "tiny-bad" / "r1" / "model.safetensors").exists()
    assert all(w["name"] != "bad-store" for w in stack.registry().json()["workers"])


def test_a_byte_changed_in_the_cache_is_refused_and_deleted_and_the_next_start_fetches_it_again(
    platform, published, first_worker, tmp_path
):
    """The cache is refused rather than silently repaired: a file that changed on disk points at a fault
    (a disk, another process) that an operator should see; deleting it lets the next start recover."""
    stack = platform.stack
    shutil.copytree(first_worker["cache"] / MODEL, tmp_path / MODEL)
    weights = tmp_path / MODEL / "r1" / "model.safetensors"
    expected, actual = flip_one_byte(weights)
    token = published["fleet_tokens"]["colocated"]
    start_worker(stack, "bad-cache", token, tmp_path)
    code, log = exit_status(stack, "bad-cache")
    assert code != 0
    assert f"checksum mismatch for model.safetensors (in the cache at {weights}; deleted it)" in log
    assert f"expected sha256 {expected}, got {actual}" in log
    assert not weights.exists()

    start_worker(stack, "bad-cache-again", token, tmp_path)
    try:
        (entry,) = stack.wait_for_workers(["bad-cache-again"])
        assert entry["revision"] == "r1"
        assert hashlib.sha256(weights.read_bytes()).hexdigest() == expected
        assert "1 file(s) fetched, " in stack.log_path("bad-cache-again").read_text()
    finally:
        stack.stop_process("bad-cache-again")


class Traffic:
    """Sends greedy requests one after another through the gateway until stopped; keeps every outcome."""

    def __init__(self, platform: Platform):
        self.platform = platform
        self.outcomes: list[tuple[str, list[int]] | Exception] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with diptych.Client(api_key=self.platform.api_key, base_url=self.platform.gateway) as client:
            while not self._stop.is_set() and len(self.outcomes) < 500:
                try:
                    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
                    self.outcomes.append((done.usage.decode.worker_id, done.token_ids))
                except Exception as error:  # every failure is kept and fails the test
                    self.outcomes.append(error)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def __exit__(self, *exc) -> None:
        self.stop()


def test_a_new_revision_drains_the_old_workers_once_one_of_it_is_ready_while_requests_succeed(
    platform, saved, published, first_worker, expected_tokens, tmp_path
):
    stack = platform.stack
    revised = tmp_path / "r2"
    shutil.copytree(saved, revised)
    generation = json.loads((revised / "generation_config.json").read_text())
    (revised / "generation_config.json").write_text(json.dumps(generation | {"diptych_note": "revision r2"}))

    with Traffic(platform) as traffic:
        assert wait_for(lambda: len(traffic.outcomes) >= 2, 30), "no request finished before the change"
        registered = json.loads(
            diptych_command(stack, "model", "register", MODEL, str(revised), "--revision", "r2", "--json")
        )
        assert (registered["revision"], registered["fleet_tokens"]) == ("r2", {}), "the fleets keep their tokens"
        beat = registry_worker(stack, "art-1")["last_heartbeat_at"]
        assert wait_for(lambda: registry_worker(stack, "art-1")["last_heartbeat_at"] != beat, 15), "no heartbeat"
        assert registry_worker(stack, "art-1")["state"] == "ready", "drained before a worker of r2 was ready"

        start_worker(stack, "art-2", published["fleet_tokens"]["colocated"], first_worker["cache"])
        try:
            (new,) = stack.wait_for_workers(["art-2"])
            assert new["revision"] == "r2"
            drained = wait_for(lambda: registry_worker(stack, "art-1")["state"] == "draining", 15)
            assert drained, f"the r1 worker was not told to drain: {registry_worker(stack, 'art-1')}"
            served = len(traffic.outcomes)
            assert wait_for(lambda: len(traffic.outcomes) >= served + 3, 30), "requests stopped after the drain"
        finally:
            traffic.stop()  # before the r2 worker stops: with r1 draining, it is the only one serving
            stack.stop_process("art-2")

    failures = [o for o in traffic.outcomes if isinstance(o, Exception)]
    assert not failures, f"{len(failures)} of {len(traffic.outcomes)} requests failed: {failures[:3]}"
    assert {tuple(tokens) for _, tokens in traffic.outcomes} == {tuple(expected_tokens)}
    assert traffic.outcomes[-1][0] == new["id"], "the last requests went to the r2 worker"  # type: ignore[index]
    assert (first_worker["cache"] / MODEL / "r2" / "generation_config.json").is_file()


@pytest.fixture(scope="module")
def s3_endpoint():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _answers(endpoint), 30), "moto's server did not start"
        s3 = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
        s3.create_bucket(Bucket=S3_BUCKET)
        yield endpoint
    finally:
        process.terminate()
        process.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.TransportError:
        return False


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": AWS_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": AWS_ENV["AWS_DEFAULT_REGION"],
    }


def test_a_model_published_to_s3_is_fetched_from_it_and_serves(s3_endpoint, saved, expected_tokens, tmp_path_factory):
    store = {"DIPTYCH_ARTIFACT_STORE": f"s3://{S3_BUCKET}/published", "DIPTYCH_ARTIFACT_S3_ENDPOINT": s3_endpoint}
    no_credentials = dict.fromkeys(AWS_ENV, "")  # the gateway gets the tokenizer's files through the control plane
    with start_platform(tmp_path_factory.mktemp("s3-platform"), no_credentials, **store, **AWS_ENV) as platform:
        stack = platform.stack
        registered = json.loads(diptych_command(stack, "model", "register", MODEL, str(saved), "--json"))
        revision = registered["revision"]
        assert len(revision) == 12 and int(revision, 16) >= 0, "the default revision is content-addressed"
        token = registered["fleet_tokens"]["colocated"]

        manifest = httpx.get(
            f"{stack.control_plane_url}/api/v1/internal/artifacts/manifest",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).json()
        prefix = f"published/{MODEL}/{revision}/"
        assert manifest["store"] == {"kind": "s3", "bucket": S3_BUCKET, "prefix": prefix, "endpoint_url": s3_endpoint}
        s3 = boto3.client("s3", endpoint_url=s3_endpoint, **_boto_credentials())
        keys = {item["Key"] for item in s3.list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix)["Contents"]}
        assert keys == {prefix + p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()}

        cache = tmp_path_factory.mktemp("s3-cache")
        start_worker(stack, "s3-1", token, cache)
        (entry,) = stack.wait_for_workers(["s3-1"])
        assert entry["revision"] == revision
        assert (cache / MODEL / revision / "model.safetensors").read_bytes() == (
            saved / "model.safetensors"
        ).read_bytes()
        completion = complete(platform)
        assert completion.token_ids == expected_tokens
        assert completion.usage.decode.worker_id == entry["id"]
