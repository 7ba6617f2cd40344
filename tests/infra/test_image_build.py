"""Builds infra/Dockerfile with buildah and runs the image: migrations, then the control plane and the gateway,
each as the image's own user through its entrypoint. The control plane's API index and the gateway's /health
must answer 200; the gateway starts only after it has fetched its secret and the catalog from the control plane.
The image's OCI labels carry the revision and build time the build was given.

No container registry is needed. The base images are stand-ins made here: Debian 12 (bookworm) from debootstrap
with Debian's Python 3.11 (for `python:3.11-slim-bookworm`) and this machine's Node.js (for
`node:20-bookworm-slim`), trusting the CAs this machine adds to Debian's, given to the build as PYTHON_BASE and
NODE_BASE. torch comes from a local CPU wheel where
one is found (the folder DIPTYCH_TORCH_WHEELS, else a find-links folder of pip's configuration), mounted into the
build, with its dependencies from pip's default index; without one, from the Dockerfile's own index.

Everything lives in a storage root of its own under /var/tmp (the vfs driver and chroot isolation: no daemon, no
overlay mounts), removed at the end with every container and image in it. It needs root, buildah and debootstrap,
and the package indexes (Debian's, PyPI, npm) reachable. It takes 4 to 5 minutes on 2 cores, so it runs only where
DIPTYCH_IMAGE_TEST=1 is set: CI (.ci/run) sets it (docs/deploy.md, "Building from local files").
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra" / "Dockerfile"
PROJECT_VERSION = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
OCI = "org.opencontainers.image."
TORCH_VERSION = re.search(r"^torch==([\d.]+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE).group(1)
OPT_IN = "DIPTYCH_IMAGE_TEST"
KEEP = "DIPTYCH_IMAGE_TEST_KEEP"  # 1: keep the storage root, its images and the logs (the path is printed)
# debootstrap's suite and the packages that make it a stand-in for python:3.11-slim-bookworm (`python` on PATH,
# venv with pip; CA certificates as the official image has them). passwd (groupadd, useradd) is in minbase.
# python3-distutils provides python3.11-distutils, which python3.11-venv needs and debootstrap does not resolve.
SUITE = "bookworm"
PYTHON_PACKAGES = ["python3.11-venv", "python3-distutils", "python-is-python3", "ca-certificates"]
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
DEBOOTSTRAP_TIMEOUT_S = 900
BUILD_TIMEOUT_S = 2400
MIGRATE_TIMEOUT_S = 300
SERVE_TIMEOUT_S = 240
STOP_GRACE_S = 20

BUILDAH = shutil.which("buildah")
DEBOOTSTRAP = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin:/sbin")
NODE, NPM = shutil.which("node"), shutil.which("npm")

pytestmark = [
    pytest.mark.skipif(os.environ.get(OPT_IN) != "1", reason=f"builds the image for minutes: set {OPT_IN}=1"),
    pytest.mark.skipif(os.geteuid() != 0, reason="buildah's chroot isolation and debootstrap need root"),
    pytest.mark.skipif(
        not (BUILDAH and DEBOOTSTRAP), reason="needs buildah and debootstrap: apt-get install -y buildah debootstrap"
    ),
    pytest.mark.skipif(not (NODE and NPM), reason="needs Node.js 20 with npm (the dashboard stage's stand-in)"),
    pytest.mark.timeout(DEBOOTSTRAP_TIMEOUT_S + BUILD_TIMEOUT_S + MIGRATE_TIMEOUT_S + 2 * SERVE_TIMEOUT_S + 300),
]


@dataclass
class Buildah:
    """buildah on a storage root of its own: vfs, chroot isolation, temporary files in the same folder."""

    workdir: Path
    log: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def prefix(self) -> list[str]:
        return [
            str(BUILDAH),
            "--root",
            str(self.workdir / "storage"),
            "--runroot",
            str(self.workdir / "run"),
            "--storage-driver",
            "vfs",
        ]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "TMPDIR": str(self.workdir / "tmp"), "BUILDAH_ISOLATION": "chroot"}

    def __call__(self, *args: str, timeout: float = 300) -> str:
        return run([*self.prefix, *args], self.log, timeout, env=self.env)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """A `buildah run` in the background, in a session of its own, its output in <name>.log."""
        with (self.workdir / f"{name}.log").open("wb") as output:
            return subprocess.Popen(
                [*self.prefix, "run", *args],
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )


def run(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Runs `command`, its output appended to `log`; fails with the output's end when it fails or runs over."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        pytest.fail(f"{' '.join(command[:8])} ran over {timeout:.0f} s:\n{output[-4000:]}")
    with log.open("a") as out:
        out.write(done.stdout + done.stderr)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command[:8])} exited {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}")
    return done.stdout.strip()


def torch_wheels() -> Path | None:
    """A folder holding the CPU build of the constrained torch for CPython 3.11: DIPTYCH_TORCH_WHEELS, else a
    find-links folder of pip's configuration (files, environment)."""
    folders = [os.environ.get("DIPTYCH_TORCH_WHEELS", "")]
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for value in re.findall(r"find-links='([^']*)'", config.stdout):
        folders.extend(value.split())
    for folder in filter(None, folders):
        if any(Path(folder).glob(f"torch-{TORCH_VERSION}+cpu-cp311-cp311-*.whl")):
            return Path(folder)
    return None


def make_base_image(buildah: Buildah, name: str) -> None:
    """Debian 12 from debootstrap with Debian's Python 3.11 and this machine's Node.js and npm under /usr/local,
    where the official node image keeps them, committed as `name`."""
    container = buildah("from", "scratch")
    try:
        root = Path(buildah("mount", container))
        # A mount namespace of its own: whatever debootstrap mounts in the new root (proc, sys) goes with it.
        mirror = [os.environ["DIPTYCH_DEBIAN_MIRROR"]] if os.environ.get("DIPTYCH_DEBIAN_MIRROR") else []
        run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                str(DEBOOTSTRAP),
                "--variant=minbase",
                f"--include={','.join(PYTHON_PACKAGES)}",
                SUITE,
                str(root),
                *mirror,
            ],
            buildah.log,
            DEBOOTSTRAP_TIMEOUT_S,
        )
        for leftover in [root / "var/lib/apt/lists", root / "var/cache/apt"]:
            for entry in leftover.glob("*"):
                if entry.is_file():
                    entry.unlink()
        node = Path(str(NODE)).resolve()
        npm_package = Path(str(NPM)).resolve().parents[1]  # .../node_modules/npm/bin/npm-cli.js
        shutil.copy2(node, root / "usr/local/bin/node")
        shutil.copytree(npm_package, root / "usr/local/lib/node_modules/npm", symlinks=True)
        for command, script in [("npm", "npm-cli.js"), ("npx", "npx-cli.js")]:
            (root / "usr/local/bin" / command).symlink_to(f"../lib/node_modules/npm/bin/{script}")
        # The CAs this machine adds to Debian's (a TLS-inspecting proxy's, a company's), so that pip and npm in
        # the build trust what this machine's own clients trust.
        local_cas = sorted(LOCAL_CAS.glob("**/*.crt"))
        for ca in local_cas:
            shutil.copy2(ca, root / "usr/local/share/ca-certificates" / ca.name)
        if local_cas:
            run(["chroot", str(root), "update-ca-certificates"], buildah.log, 120)
        for check in [["/usr/local/bin/node", "--version"], ["python", "--version"]]:
            run(["chroot", str(root), *check], buildah.log, 60)
        buildah("umount", container)
        buildah(
            "config",
            "--env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--env",
            "LANG=C.UTF-8",
            "--env",  # node and pip bring CA bundles of their own: have them read the system's
            f"NODE_EXTRA_CA_CERTS={CA_BUNDLE}",
            "--env",
            f"PIP_CERT={CA_BUNDLE}",
            "--cmd",
            "python3",
            container,
        )
        buildah("commit", "--rm", container, name, timeout=600)
    except BaseException:
        subprocess.run([*buildah.prefix, "rm", container], capture_output=True, env=buildah.env)
        raise


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def first_answer(url: str, deadline: float, servers: dict[str, subprocess.Popen], workdir: Path) -> tuple[int, str]:
    """The first HTTP answer at `url` (any status), while every server still runs; fails at the deadline."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        for name, server in servers.items():
            if server.poll() is not None:
                output = (workdir / f"{name}.log").read_text(errors="replace")
                pytest.fail(f"{name} exited {server.returncode} before {url} answered:\n{output[-6000:]}")
        try:
            with opener.open(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    logs = {name: (workdir / f"{name}.log").read_text(errors="replace")[-3000:] for name in servers}
    pytest.fail(f"no answer at {url} in time: {logs}")


def processes_rooted_under(folder: Path) -> list[int]:
    """The processes whose root directory lies in `folder`: those started in this test's containers."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                root = Path(os.readlink(entry / "root"))
            except OSError:
                continue
            if root.is_relative_to(folder):
                found.append(int(entry.name))
    return found


def stop(servers: dict[str, subprocess.Popen], workdir: Path) -> None:
    """SIGTERM to each `buildah run` started here (its process group), SIGKILL after the grace period, then
    SIGKILL to anything still running inside the containers."""
    for server in servers.values():
        _signal_group(server, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for server in servers.values():
        try:
            server.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(server, signal.SIGKILL)
            server.wait(10)
    for pid in processes_rooted_under(workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _signal_group(server: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signum)  # started with a session of its own: its group id is its pid


def unmount_under(folder: Path) -> None:
    """Unmounts whatever is still mounted below `folder` (deepest first), so that removing it removes only it."""
    mounts = [Path(line.split()[1]) for line in Path("/proc/self/mounts").read_text().splitlines()]
    below = [mountpoint for mountpoint in mounts if mountpoint.is_relative_to(folder)]
    for mountpoint in sorted(below, key=lambda path: len(path.parts), reverse=True):
        subprocess.run(["umount", "--lazy", str(mountpoint)], capture_output=True)


def forward_policy() -> str | None:
    """The root namespace's iptables FORWARD policy (None without iptables)."""
    if shutil.which("iptables") is None:
        return None
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout.splitlines()
    return rules[0].split()[-1] if rules and rules[0].startswith("-P FORWARD") else "ACCEPT"


@pytest.fixture
def buildah() -> Iterator[Buildah]:
    workdir = Path(tempfile.mkdtemp(prefix="diptych-image-", dir="/var/tmp"))
    (workdir / "tmp").mkdir()
    tool = Buildah(workdir, workdir / "build.log")
    # A build here leaves the machine's FORWARD policy at DROP (seen: ACCEPT before, DROP after), which cuts
    # every later bridged link on the machine, the multi-host harness's included: put it back as it was.
    policy = forward_policy()
    try:
        yield tool
    finally:
        if policy is not None and forward_policy() != policy:
            print(f"the build changed the FORWARD policy to {forward_policy()}; restoring {policy}")
            subprocess.run(["iptables", "-P", "FORWARD", policy], capture_output=True)
        print("timings (s):", json.dumps(tool.timings))
        if os.environ.get(KEEP) == "1":
            print(f"kept for a look ({KEEP}=1): {' '.join(tool.prefix)} images; logs in {workdir}")
        else:
            for command in (["rm", "--all"], ["rmi", "--all", "--force"]):
                subprocess.run([*tool.prefix, *command], capture_output=True, env=tool.env, timeout=300)
            unmount_under(workdir)
            shutil.rmtree(workdir)


def test_the_image_builds_from_local_bases_and_serves(buildah):
    base, image = "localhost/diptych-test-base:bookworm", "localhost/diptych-test:latest"
    started = time.monotonic()
    make_base_image(buildah, base)
    buildah.timings["base image"] = round(time.monotonic() - started, 1)

    build_args = {"NODE_BASE": base, "PYTHON_BASE": base}
    # What a release build gives the OCI labels (infra/Dockerfile's last ARGs).
    revision = run(["git", "-C", str(REPO), "rev-parse", "HEAD"], buildah.log, 30)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    build_args |= {"IMAGE_REVISION": revision, "IMAGE_CREATED": created}
    volumes: list[str] = []
    wheels = torch_wheels()
    if wheels is not None:
        # pip's default index for torch's dependencies; the local CPU wheel outranks PyPI's torch (+cpu is newer).
        build_args |= {"TORCH_INDEX_URL": "", "TORCH_FIND_LINKS": "/wheels"}
        volumes = ["--volume", f"{wheels}:/wheels:ro"]
    started = time.monotonic()
    built = buildah(
        "bud",
        "--isolation",
        "chroot",
        "--pull=never",
        "--file",
        str(DOCKERFILE),
        "--tag",
        image,
        *[word for name, value in build_args.items() for word in ("--build-arg", f"{name}={value}")],
        *volumes,
        str(REPO),
        timeout=BUILD_TIMEOUT_S,
    )
    buildah.timings["build"] = round(time.monotonic() - started, 1)
    assert "paged-cpu attention operator built" in built  # CPU workers attend in place, with no compile at start

    (config,) = [json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]]
    assert config["User"] == "diptych" and config["WorkingDir"] == "/app"
    entrypoint = config["Entrypoint"]
    assert entrypoint == ["diptych"]
    labels = {key.removeprefix(OCI): value for key, value in config["Labels"].items() if key.startswith(OCI)}
    assert labels["revision"] == revision and labels["created"] == created, labels
    assert labels["title"] == "diptych" and labels["version"] == PROJECT_VERSION, labels
    assert {"description", "source", "licenses"} <= set(labels), labels

    started = time.monotonic()
    container = buildah("from", "--pull=never", image, timeout=600)
    token = f"image-test-{os.urandom(8).hex()}"
    env = ["--env", f"DIPTYCH_INTERNAL_TOKEN={token}"]
    # No DATABASE_URL: the control plane's embedded mode, SQLite under DIPTYCH_STATE_DIR (/var/lib/diptych).
    migrate = ["python", "manage.py", "migrate", "--noinput"]
    migrated = buildah("run", *env, container, "--", *migrate, timeout=MIGRATE_TIMEOUT_S)
    assert "Applying" in migrated or "No migrations to apply" in migrated, migrated
    assert buildah("run", container, "--", "id", "-un") == "diptych"
    buildah.timings["container and migrations"] = round(time.monotonic() - started, 1)

    cp_port, grpc_port, http_port, metrics_port = (free_port() for _ in range(4))
    servers: dict[str, subprocess.Popen] = {}
    try:
        started = time.monotonic()
        control_plane = [*entrypoint, "control-plane", "--host", "127.0.0.1", "--port", str(cp_port)]
        control_plane += ["--processes", "1"]
        servers["control-plane"] = buildah.start("control-plane", *env, container, "--", *control_plane)
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        status, body = first_answer(f"http://127.0.0.1:{cp_port}/api/v1/", deadline, servers, buildah.workdir)
        assert status == 200, body
        index = json.loads(body)
        assert index["object"] == "api" and index["version"] == "v1" and index["resources"], index
        buildah.timings["control plane answers"] = round(time.monotonic() - started, 1)

        started = time.monotonic()
        gateway = [
            *entrypoint,
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(metrics_port),
            "--control-plane-url",
            f"http://127.0.0.1:{cp_port}",
        ]
        servers["gateway"] = buildah.start("gateway", *env, container, "--", *gateway)
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        status, body = first_answer(f"http://127.0.0.1:{http_port}/health", deadline, servers, buildah.workdir)
        assert (status, json.loads(body)) == (200, {"status": "ok"}), body
        buildah.timings["gateway answers"] = round(time.monotonic() - started, 1)
        print(f"/api/v1/ -> 200 {json.dumps(index)[:300]}\n/health -> {status} {body}")
    finally:
        stop(servers, buildah.workdir)
