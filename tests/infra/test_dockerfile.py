"""infra/Dockerfile builds from a fresh clone. Docker's daemon is not available where the tests run, so the
file is checked as the builder reads it: its stages, the base each variant (cpu, cuda) resolves to, that every
COPY source is in a fresh clone (and not left out of the context by .dockerignore) or made by an earlier stage,
and that .dockerignore keeps environments, state and build outputs out of the build context."""

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
VARIANTS = ["cpu", "cuda"]
IMAGE_UID = IMAGE_GID = 10001  # the Helm chart runs every pod as this user and group
CONTEXT_LIMIT_BYTES = 100 * 1024 * 1024  # the sources are a few MB; an environment or a cache is far more


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (keyword, arguments)
    args: dict[str, str] = field(default_factory=dict)  # the stage's own ARGs: a --build-arg's value or the default


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # continuation lines
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


def _expand(word: str, args: dict[str, str]) -> str:
    """A FROM's words with the build arguments in `args` substituted as builders do: $X, ${X}, ${X:-default}
    (the default when X is unset or empty); an argument not in `args` is empty."""

    def value(match: re.Match) -> str:
        name, default = match.group("braced") or match.group("bare"), match.group("default")
        given = args.get(name, "")
        return given if given or default is None else default

    return re.sub(r"\$(?:\{(?P<braced>\w+)(?::-(?P<default>[^}]*))?\}|(?P<bare>\w+))", value, word)


def _stages(variant: str | None, header_defaults: bool = True, build_args: dict[str, str] | None = None) -> list[Stage]:
    """The stages as the builder sees them with --build-arg VARIANT=<variant> (None: no --build-arg) and the
    other `build_args`, reading the defaults of the ARGs before the first FROM (`header_defaults`) as Docker
    does, or not, as buildah before 1.29 does when it matches a FROM against the stages' names."""
    given = dict(build_args or {})
    if variant is not None:
        given["VARIANT"] = variant
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, arguments in _instructions():
        if keyword == "ARG":
            name, _, default = arguments.partition("=")
            default = " ".join(shlex.split(default))  # a quoted default is its words, as the builder reads it
            if stages:
                stages[-1].args[name] = given.get(name, default)
            elif name in given:
                global_args[name] = given[name]
            elif header_defaults:
                global_args[name] = default
        elif keyword == "FROM":
            base, _, name = _expand(arguments, global_args).partition(" AS ")
            stages.append(Stage(name.strip(), base.strip()))
        else:
            stages[-1].instructions.append((keyword, arguments))
    return stages


def _fresh_clone_paths() -> set[str]:
    """What a fresh clone of the working tree holds: tracked files and those git would add (not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    return {path for path in listed.stdout.splitlines() if (REPO / path).exists()}


def _ignore_patterns() -> list[re.Pattern]:
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert not line.startswith("!"), "exceptions are not used here; the check below does not read them"
            regex = (
                re.escape(line.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            )
            patterns.append(re.compile(regex))
    return patterns


def _ignored(path: str, patterns: list[re.Pattern]) -> bool:
    """Whether .dockerignore leaves `path` out: a pattern matching it or any folder above it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(pattern.fullmatch(prefix) for pattern in patterns for prefix in prefixes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_copy_source_is_in_a_fresh_clone_or_made_by_an_earlier_stage(variant):
    stages = _stages(variant)
    clone, patterns = _fresh_clone_paths(), _ignore_patterns()
    in_context = {path for path in clone if not _ignored(path, patterns)}
    for index, stage in enumerate(stages):
        for keyword, arguments in stage.instructions:
            if keyword != "COPY":
                continue
            words = arguments.split()
            options = [w for w in words if w.startswith("--")]
            *sources, _ = [w for w in words if not w.startswith("--")]
            source_stage = next((o.split("=", 1)[1] for o in options if o.startswith("--from=")), None)
            if source_stage is not None:
                earlier = [s.name for s in stages[:index]]
                assert source_stage in earlier, f"{stage.name} copies from {source_stage}, not an earlier stage"
                continue
            for source in sources:
                source = source.rstrip("/")
                made = [p for p in in_context if p == source or p.startswith(source + "/")]
                assert made, f"{stage.name}: COPY {source} is not in the build context of a fresh clone"


def _torch_install(stage: Stage) -> str:
    """The stage's `pip install ... torch==...` command."""
    (command,) = [
        command.strip()
        for keyword, arguments in stage.instructions
        if keyword == "RUN"
        for command in arguments.split("&&")
        if "torch==" in command
    ]
    return command


def _pip_arguments(stage: Stage) -> list[str]:
    """The arguments the torch install gives pip, as the image's /bin/sh expands them with the stage's ARGs
    (a RUN sees its stage's ARGs as environment variables)."""
    install = _torch_install(stage)
    assert install.startswith("/opt/venv/bin/pip install "), install
    echo = "printf '%s\\n' " + install.removeprefix("/opt/venv/bin/pip install ")
    shown = subprocess.run(["sh", "-c", echo], env={**stage.args, "PATH": os.defpath}, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.splitlines()


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_builds_the_runtime_on_its_torch(variant):
    stages = {stage.name: stage for stage in _stages(variant)}
    runtime = _stages(variant)[-1]
    assert runtime.name == "runtime" and runtime.base == f"base-{variant}"
    base = stages[runtime.base]
    torch_installs = " ".join(_pip_arguments(base))
    if variant == "cuda":
        assert base.base.startswith("nvidia/cuda:") and "runtime" in base.base
        assert re.search(r"--index-url https://download\.pytorch\.org/whl/cu\d+ ", torch_installs), torch_installs
    else:
        assert re.search(r"--index-url https://download\.pytorch\.org/whl/cpu ", torch_installs), torch_installs
    assert "--find-links" not in torch_installs
    constraints = (REPO / "constraints.txt").read_text()
    assert re.search(r"torch==([\d.]+)", torch_installs).group(1) == re.search(r"torch==([\d.]+)", constraints).group(1)
    runs = " ".join(a for k, a in base.instructions if k == "RUN")
    assert "python3.11" in base.base or "python:3.11" in base.base or "python3.11" in runs
    assert "ENTRYPOINT" in {k for k, _ in runtime.instructions}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_base_images_and_torch_s_source_are_build_arguments(variant):
    """A machine without a container registry or the PyTorch index builds from local images and a local wheel
    (tests/infra/test_image_build.py does): the bases are ARGs, and so are torch's index and a wheel folder."""
    local = {
        "NODE_BASE": "localhost/bookworm-node:20",
        "PYTHON_BASE": "localhost/bookworm-python:3.11",
        "CUDA_BASE": "localhost/cuda-runtime:12.8",
        "TORCH_INDEX_URL": "",
        "TORCH_FIND_LINKS": "/wheels",
    }
    stages = {stage.name: stage for stage in _stages(variant, build_args=local)}
    assert stages["dashboard"].base == local["NODE_BASE"]
    assert stages["base-cpu"].base == local["PYTHON_BASE"]
    assert stages["base-cuda"].base == local["CUDA_BASE"]
    torch = re.search(r"^torch==[\d.]+$", (REPO / "constraints.txt").read_text(), re.MULTILINE).group(0)
    # An empty index is pip's own default one (torch's dependencies come from there); the folder is looked in too.
    assert _pip_arguments(stages[f"base-{variant}"]) == ["--no-cache-dir", "--find-links", "/wheels", torch]


def test_the_dashboard_is_built_in_a_stage_and_copied_from_its_output():
    stages = {stage.name: stage for stage in _stages("cpu")}
    dashboard = stages["dashboard"]
    runs = [a for k, a in dashboard.instructions if k == "RUN"]
    assert any(a.startswith("npm ci") for a in runs) and "npm run build" in runs
    (workdir,) = [a for k, a in dashboard.instructions if k == "WORKDIR"]
    out_dir = re.search(r'outDir: "(\w+)"', (REPO / "frontend" / "vite.config.ts").read_text()).group(1)
    copies = [a for k, a in stages["runtime"].instructions if k == "COPY" and a.startswith("--from=dashboard")]
    assert copies == [f"--from=dashboard {workdir}/{out_dir} ./frontend/dist"]


def test_every_base_image_is_pinned():
    for variant in VARIANTS:
        for stage in _stages(variant):
            if not stage.base.startswith("base-"):
                assert ":" in stage.base and not stage.base.endswith(":latest"), stage.base


def test_dockerignore_keeps_environments_state_and_build_outputs_out_of_the_context():
    patterns = _ignore_patterns()
    for path in [
        ".venv/bin/python",
        ".diptych/controlplane.sqlite3",
        "frontend/node_modules/vite/package.json",
        "frontend/dist/index.html",
        ".git/HEAD",
        "gateway/__pycache__/main.cpython-311.pyc",
        ".mypy_cache/3.11/x.json",
        "diptych_server.egg-info/PKG-INFO",
    ]:
        assert _ignored(path, patterns), path
    for path in ["gateway/main.py", "frontend/package-lock.json", "frontend/src/main.ts", "pyproject.toml"]:
        assert not _ignored(path, patterns), path


def test_the_build_context_of_this_checkout_is_small():
    """Walks this checkout as the builder would send it (its .venv, caches and node_modules included here)."""
    patterns = _ignore_patterns()
    total = 0
    for top, folders, files in os.walk(REPO):
        folder = Path(top)
        relative = folder.relative_to(REPO).as_posix()
        folders[:] = [f for f in folders if not _ignored(f if relative == "." else f"{relative}/{f}", patterns)]
        for name in files:
            path = name if relative == "." else f"{relative}/{name}"
            if not _ignored(path, patterns) and not (folder / name).is_symlink():
                total += (folder / name).stat().st_size
    assert total < CONTEXT_LIMIT_BYTES, f"the build context would be {total / 2**20:.0f} MiB"


def test_the_image_runs_the_diptych_command_and_holds_compose_s_entrypoint():
    runtime = _stages("cpu")[-1]
    (entrypoint,) = [a for k, a in runtime.instructions if k == "ENTRYPOINT"]
    (program,) = re.fullmatch(r'\["(\w+)"\]', entrypoint).groups()
    project = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^{program} = "diptych_server\.cli:main"$', project, re.MULTILINE)
    installed = {a.split()[-1] for k, a in runtime.instructions if k == "COPY" and a.startswith("infra/docker/")}
    compose = (REPO / "infra" / "compose.yaml").read_text()
    (used,) = set(re.findall(r'entrypoint: \["([\w-]+)"\]', compose))
    assert f"/usr/local/bin/{used}" in installed
    assert os.access(REPO / "infra" / "docker" / used, os.X_OK), "COPY keeps the mode: the script must be executable"


def test_every_package_the_project_installs_is_copied_into_the_image():
    """The image installs the project editable from /app: a package pyproject installs but the Dockerfile does
    not copy is missing at run time (the gateway imports planner, for one)."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in setuptools["include"]}
    roots = {root for root in setuptools["where"] if root != "."}
    runtime = next(stage for stage in _stages("cpu") if stage.name == "runtime")
    copied = {a.split()[0].rstrip("/") for k, a in runtime.instructions if k == "COPY" and not a.startswith("--")}
    for package in packages:
        where = next((root for root in roots if (REPO / root / package).is_dir()), package)
        assert where in copied, f"the image does not copy {where}/ (package {package})"


def test_without_build_arguments_every_builder_builds_the_cpu_runtime():
    """No --build-arg: Docker reads the default of `ARG VARIANT=cpu`; buildah before 1.29 (Debian 12's 1.28.2,
    which then tries to pull `base-cpu` from a registry) matches a FROM against the stages' names without it, so
    the FROM must name base-cpu either way."""
    for header_defaults in (True, False):
        stages = _stages(None, header_defaults=header_defaults)
        runtime = stages[-1]
        assert runtime.base == "base-cpu", f"reading header defaults: {header_defaults}: FROM {runtime.base}"
        assert runtime.base in [stage.name for stage in stages[:-1]]


def _runtime_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, arguments in _stages("cpu")[-1].instructions:
        if keyword == "ENV":
            env.update(word.partition("=")[::2] for word in shlex.split(arguments))
    return env


@dataclass
class ImageUser:
    name: str
    uid: int
    gid: int
    home: str
    state_dir: str


def image_user() -> ImageUser:
    """The user the image runs as (its USER, as `useradd` creates it), its HOME and DIPTYCH_STATE_DIR."""
    runtime = _stages("cpu")[-1]
    (user,) = [a for k, a in runtime.instructions if k == "USER"]
    (useradd,) = [words for words in _commands(runtime, "useradd") if words[-1] == user]
    env = _runtime_env()
    return ImageUser(
        name=user,
        uid=int(_option(useradd, "--uid", "-u") or 0),
        gid=int(_option(useradd, "--gid", "-g") or 0),
        home=env.get("HOME", ""),
        state_dir=env["DIPTYCH_STATE_DIR"],
    )


def _commands(stage: Stage, program: str) -> list[list[str]]:
    """Every `program ...` command of the stage's RUN instructions, split into words."""
    found = []
    for keyword, arguments in stage.instructions:
        if keyword == "RUN":
            for command in re.split(r"&&|;", arguments):
                words = shlex.split(command)
                if words and words[0] == program:
                    found.append(words)
    return found


def _option(words: list[str], *names: str) -> str | None:
    for index, word in enumerate(words):
        if word in names:
            return words[index + 1]
        for name in names:
            if name.startswith("--") and word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def test_the_image_s_user_has_a_home_directory_it_owns_and_home_names_it():
    """Without a home directory gunicorn fails with "Permission denied: '/home/diptych'"; HOME is set as well,
    so that a runtime giving the uid without reading /etc/passwd still finds it."""
    runtime = _stages("cpu")[-1]
    (user,) = [a for k, a in runtime.instructions if k == "USER"]
    (useradd,) = _commands(runtime, "useradd")
    assert useradd[-1] == user
    assert "--create-home" in useradd or "-m" in useradd, f"the user is created without its home: {useradd}"
    home = _option(useradd, "--home-dir", "-d") or f"/home/{user}"
    assert _runtime_env().get("HOME") == home
    assert _option(useradd, "--uid", "-u") == str(IMAGE_UID)
    (groupadd,) = _commands(runtime, "groupadd")
    assert _option(groupadd, "--gid", "-g") == _option(useradd, "--gid", "-g") == str(IMAGE_GID)
    assert groupadd[-1] == user


OCI_LABELS = ["title", "description", "source", "version", "revision", "created", "licenses"]
OCI_PREFIX = "org.opencontainers.image."


def _labels(stage: Stage) -> dict[str, str]:
    """The stage's LABELs as written, before the builder substitutes its ARGs."""
    labels: dict[str, str] = {}
    for keyword, arguments in stage.instructions:
        if keyword == "LABEL":
            labels.update(word.partition("=")[::2] for word in shlex.split(arguments))
    return labels


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_image_carries_the_oci_labels_each_from_a_build_argument(variant):
    """Each label names a build argument of the runtime stage itself (an ARG declared only before the first FROM
    is empty there), whose default says what the source tree knows and which a release build overrides."""
    import tomllib

    runtime = _stages(variant)[-1]
    written = _labels(runtime)
    assert {f"{OCI_PREFIX}{name}" for name in OCI_LABELS} <= set(written), sorted(written)
    arguments = {}
    for name in OCI_LABELS:
        reference = re.fullmatch(r"\$\{(\w+)\}", written[OCI_PREFIX + name])
        assert reference and reference.group(1) in runtime.args, f"{name}: {written[OCI_PREFIX + name]}"
        arguments[name] = reference.group(1)

    defaults = {name: runtime.args[arguments[name]] for name in OCI_LABELS}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert defaults["title"] == "diptych"
    assert defaults["description"] == project["description"]
    assert defaults["version"] == project["version"]
    assert re.fullmatch(r"NOASSERTION|[A-Za-z0-9.+-]+( (AND|OR|WITH) [A-Za-z0-9.+-]+)*", defaults["licenses"])

    given = {
        "source": "https://git.example.com/diptych.git",
        "version": "0.2.0",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "created": "2026-12-02T10:00:00Z",
    }
    built = _stages(variant, build_args={arguments[name]: value for name, value in given.items()})[-1]
    assert {name: built.args[arguments[name]] for name in given} == given


def test_the_labels_come_after_every_layer_so_a_new_revision_rebuilds_none():
    """A changed ARG invalidates the cache of every RUN after its declaration: the labels' ARGs come last."""
    every = _instructions()
    last_from = max(i for i, (keyword, _) in enumerate(every) if keyword == "FROM")
    instructions = every[last_from + 1 :]  # the runtime stage's, its ARGs among them
    label_arguments = set(re.findall(r"\$\{(\w+)\}", " ".join(a for k, a in instructions if k == "LABEL")))
    assert label_arguments, "the runtime stage has no LABEL taken from a build argument"
    declared = [i for i, (k, a) in enumerate(instructions) if k == "ARG" and a.partition("=")[0] in label_arguments]
    assert declared, "the labels' build arguments are not declared in the runtime stage"
    last_layer = max(i for i, (k, _) in enumerate(instructions) if k in {"RUN", "COPY", "ADD"})
    assert min(declared) > last_layer, instructions[last_layer:]
