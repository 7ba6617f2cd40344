"""Starts the platform for the benchmark with `diptych_server.stack.Stack`: the control plane on a SQLite
file of its own, then one serving mode at a time (its workers and its gateway), so that the mode being
measured has the machine's cores to itself."""

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from diptych_server.stack import REPO_ROOT, UNLIMITED_NEW_ORGANIZATIONS, Stack, free_port

MODE_ROLES = {"split": ("prefill", "decode"), "colocated": ("colocated",)}
MODES = tuple(MODE_ROLES)


@dataclass
class LivePlatform:
    stack: Stack
    api_key: str
    model: str
    fleet_tokens: dict[str, str]  # role -> fleet token
    threads: dict[str, int]  # role -> torch threads of its worker
    log: Callable[[str], None]
    worker_args: tuple[str, ...] = ()  # given to every worker it starts
    http_urls: dict[str, str] = field(default_factory=dict)  # mode -> its gateway's OpenAI API, while it serves

    @contextmanager
    def serving(self, mode: str) -> Iterator[str]:
        """Starts the mode's workers and its gateway; yields the gateway's host:port; stops them."""
        names = []
        try:
            for role in MODE_ROLES[mode]:
                name = f"{role}-0"
                self.log(
                    f"starting the {role} worker ({self.model}, {self.threads[role]} torch thread(s)); "
                    "it loads the model"
                )
                self.stack.start_worker(
                    name,
                    role,
                    self.fleet_tokens[role],
                    free_port(),
                    "--model",
                    self.model,
                    "--model-source",
                    f"builtin:{self.model}",
                    "--threads",
                    str(self.threads[role]),
                    *self.worker_args,
                )
                names.append(name)
            self.stack.wait_for_workers(names, timeout=300)
            port, http_port = free_port(), free_port()
            self.log(f"starting the {mode} gateway on 127.0.0.1:{port} (HTTP {http_port})")
            names.append(f"gateway-{mode}")
            self.stack.start_gateway(names[-1], port, free_port(), mode, http_port=http_port)
            self.http_urls[mode] = f"http://127.0.0.1:{http_port}/v1"
            yield f"127.0.0.1:{port}"
        finally:
            self.http_urls.pop(mode, None)
            self.log(f"stopping the {mode} workers and gateway")
            self._stop_in_parallel([name for name in names if name in self.stack.processes])

    def stop(self) -> None:
        self.stack.stop()

    def _stop_in_parallel(self, names: list[str]) -> None:
        """Each process may take its grace period to drain: stop them side by side."""
        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            list(pool.map(self.stack.stop_process, names))


def start_platform(
    state_dir: Path,
    model: str,
    context_length: int,
    split_threads: int,
    colocated_threads: int,
    log,
    worker_args: tuple[str, ...] = (),
) -> LivePlatform:
    """The control plane with the model in its catalog and a demo API key; no workers yet (they start with
    `worker_args` besides their own)."""
    stack = Stack(
        state_dir,
        control_plane_port=free_port(),
        database_url=f"sqlite:///{state_dir / 'cp.sqlite3'}",
        extra_env=UNLIMITED_NEW_ORGANIZATIONS,
    )
    try:
        log("migrating the control plane's database and issuing a demo key")
        credentials = stack.prepare_control_plane(demo=True)
        fleet_tokens = _bootstrap_model(stack, model, context_length)
        log(f"starting the control plane on {stack.control_plane_url}")
        stack.start_control_plane()
    except BaseException:
        stack.stop()
        raise
    threads = {"prefill": split_threads, "decode": split_threads, "colocated": colocated_threads}
    return LivePlatform(stack, credentials.api_key, model, fleet_tokens, threads, log, worker_args)


def _bootstrap_model(stack: Stack, model: str, context_length: int) -> dict[str, str]:
    """Puts the model in the catalog with its fleets; returns fresh fleet tokens."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "manage.py"),
            "bootstrap",
            "--json",
            "--model",
            model,
            "--context-length",
            str(context_length),
        ],
        cwd=REPO_ROOT,
        env=stack.env(),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py bootstrap --model {model} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)["fleet_tokens"]


def save_model(model: str, directory: Path) -> None:
    """The built-in model as a Hugging Face directory, written by `diptych model save` as any user would."""
    result = subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", "model", "save", model, str(directory)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"diptych model save {model} failed:\n{result.stderr[-3000:]}")
