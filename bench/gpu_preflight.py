"""What the GPU run will run on, checked before it measures anything.

`bash bench/gpu_check.sh` runs this first and runs nothing else when it fails (exit 1): a module the steps
import does not import, a carried wheel is not the version installed, an API the steps call without a guard
is missing from this torch or transformers, or the attention backend under test cannot run here at a dtype
the steps give it. A step would otherwise measure the old path under the new one's name.

    python -m bench.gpu_preflight --device cuda --attention triton                # on the GPU machine
    TRITON_INTERPRET=1 .venv/bin/python -m bench.gpu_preflight --device cpu --attention triton

It prints the versions (Python, torch, triton, transformers, CUDA and the device), where each carried package
was found and which of the image's the steps use, the APIs the steps lean on, and for each attention backend
what `choose_backend` gives on this device at each dtype the steps run, or why that backend cannot run.
"""

import argparse
import importlib
import importlib.metadata
import inspect
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models.backends import ATTENTION_BACKENDS, AttentionBackendUnavailable, choose_backend

REPO = Path(__file__).resolve().parents[1]
WHEEL_SCRIPT = REPO / "bench" / "gpu_wheels.sh"
IMAGE_PACKAGES = REPO / "bench" / "gpu_image_packages.txt"

# what the steps of bench/gpu_check.sh run (with the workers' modules they load), and the kernel test's modules
STEP_MODULES = (
    "bench.gpu_preflight",
    "bench.decode_floor",
    "bench.gpu_serving",
    "bench.gpu_split",
    "bench.gpu_busy",
    "bench.phase_costs",
    "workers.models.triton_attention",
)
KERNEL_TEST_MODULES = ("tests.conftest", "tests.workers.conftest", "tests.workers.test_triton_attention")
BLOCK_SIZE = 16  # the steps' blocks; flash-varlen reads pages of 256 tokens
FLASH_VARLEN_BLOCK_SIZE = 256


@dataclass(frozen=True)
class Finding:
    what: str
    ok: bool
    detail: str
    required: bool = True  # False: a fact for the reader; its absence fails nothing

    def line(self) -> str:
        mark = "ok" if self.ok else ("MISSING" if self.required else "no")
        return f"  {mark:7s} {self.what}: {self.detail}"


# ---- the wheel list and the image's packages -----------------------------------------------------------------


def normalized(name: str) -> str:
    """A distribution's name as package indexes compare them: lowercase, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_wheels(script: Path = WHEEL_SCRIPT) -> dict[str, str]:
    """name -> pinned version, from the `wheels=( ... )` list of bench/gpu_wheels.sh."""
    text = script.read_text()
    match = re.search(r"^wheels=\($(.*?)^\)$", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError(f"{script} holds no wheels=( ... ) list")
    pins = {}
    for line in match.group(1).splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            name, _, version = entry.partition("==")
            if not version:
                raise ValueError(f"{script}: {entry!r} is not pinned as NAME==VERSION")
            pins[normalized(name)] = version
    return pins


def image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """name -> version (None where none was recorded) of the GPU image's Python packages."""
    packages: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            name, _, version = entry.partition("==")
            packages[normalized(name)] = version or None
    return packages


# ---- what this machine has -----------------------------------------------------------------------------------


def versions(device: torch.device) -> list[str]:
    try:
        import triton

        triton_version = f"triton {triton.__version__}"
    except ImportError as error:
        triton_version = f"no triton ({error})"
    import transformers

    lines = [
        f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
        f"{triton_version}, transformers {transformers.__version__}",
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}",
    ]
    if device.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(device)
        lines.append(
            f"{p.name}: {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} multiprocessors, "
            f"compute capability {p.major}.{p.minor}"
        )
    elif device.type == "cuda":
        lines.append("no CUDA device visible to this torch")
    else:
        lines.append(f"CPU: {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    return lines


def import_modules(names: tuple[str, ...]) -> list[str]:
    """Imports each module; the failures, as `module: error`."""
    failures = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:
            failures.append(f"{name}: {type(error).__name__}: {error}")
    return failures


def carried_packages(pins: dict[str, str]) -> list[Finding]:
    """Each carried wheel's distribution as this interpreter finds it first on its path: its version and where."""
    found = []
    for name, pinned in pins.items():
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            found.append(Finding(f"{name}=={pinned}", False, "not installed"))
            continue
        where = str(distribution.locate_file("")).removesuffix("/")
        ok = distribution.version == pinned
        found.append(Finding(f"{name}=={pinned}", ok, f"{distribution.version} in {where}"))
    return found


def loaded_distributions() -> set[str]:
    """The third-party distributions whose modules are loaded now (optional imports of other packages among
    them), the repository's own left out."""
    by_top_level = importlib.metadata.packages_distributions()
    ours = {name.partition(".")[0] for name in repository_modules()}
    loaded = {name.partition(".")[0] for name in sys.modules} - ours
    return {normalized(d) for top in loaded for d in by_top_level.get(top, ())}


def repository_modules() -> list[str]:
    """The loaded modules that are the repository's own (not of a virtual environment inside it)."""
    names = []
    for name, module in list(sys.modules.items()):
        path = Path(getattr(module, "__file__", None) or "/")
        if path.is_relative_to(REPO) and not path.relative_to(REPO).parts[0].startswith("."):
            names.append(name)
    return names


def api_findings(attention: str) -> list[Finding]:
    """The torch, transformers and triton APIs the steps call, and which of them have guards."""
    from torch.nn import functional

    findings = []
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)
    try:
        functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        sdpa = Finding("scaled_dot_product_attention(enable_gqa=) (gather)", True, "torch >= 2.5")
    except TypeError as error:
        sdpa = Finding("scaled_dot_product_attention(enable_gqa=) (gather)", False, str(error))
    findings.append(sdpa)
    graphs = all(hasattr(torch.cuda, name) for name in ("CUDAGraph", "graph", "graph_pool_handle"))
    findings.append(Finding("torch.cuda.CUDAGraph, graph, graph_pool_handle (graphs)", graphs, "unguarded"))
    kineto = getattr(torch._C._autograd, "_KinetoEvent", None)  # what a finished profile's events are
    profiled = all(hasattr(kineto, name) for name in ("name", "device_type", "start_ns", "end_ns", "metadata_json"))
    findings.append(Finding("profiler events: start_ns, end_ns, metadata_json (gpu_busy)", profiled, "unguarded"))
    findings.append(_varlen_finding(attention == "flash-varlen"))
    from transformers import LlamaForCausalLM

    batching = "continuous_batching_config" in inspect.signature(LlamaForCausalLM.init_continuous_batching).parameters
    findings.append(Finding("init_continuous_batching(continuous_batching_config=)", batching, "transformers CB"))
    return findings


def _varlen_finding(required: bool) -> Finding:
    """torch.nn.attention.varlen's paged parameters arrived after 2.11 (flash-varlen's guard checks them)."""
    what = "varlen_attn(block_table=, seqused_k=, enable_gqa=) (flash-varlen)"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return Finding(what, False, f"torch {torch.__version__} has no torch.nn.attention.varlen", required)
    parameters = inspect.signature(varlen_attn).parameters
    missing = [name for name in ("block_table", "seqused_k", "enable_gqa") if name not in parameters]
    if missing:
        return Finding(what, False, f"lacks {', '.join(missing)}: guarded, flash-varlen cannot run", required)
    return Finding(what, True, "flash-varlen can read the pool in place", required)


# ---- attention ----------------------------------------------------------------------------------------------


def attention_choices(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> dict[tuple[str, torch.dtype], str]:
    """(requested backend, dtype) -> the backend `choose_backend` gives, or `cannot run: why`."""
    choices = {}
    for requested in ATTENTION_BACKENDS:
        block_size = FLASH_VARLEN_BLOCK_SIZE if requested == "flash-varlen" else BLOCK_SIZE
        for dtype in dtypes:
            try:
                choices[(requested, dtype)] = choose_backend(requested, device, dtype, block_size)
            except AttentionBackendUnavailable as error:
                choices[(requested, dtype)] = f"cannot run: {error}"
    return choices


def render_choices(choices: dict[tuple[str, torch.dtype], str], device: torch.device) -> list[str]:
    blocks = f"blocks of {BLOCK_SIZE} tokens; flash-varlen {FLASH_VARLEN_BLOCK_SIZE}"
    lines = [f"attention on {device} (choose_backend, {blocks}):"]
    for (requested, dtype), chosen in choices.items():
        lines.append(f"  {requested:13s} {str(dtype).removeprefix('torch.'):9s} {chosen}")
    return lines


def step_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """On CUDA the steps run bfloat16 and the parity steps float32; on the CPU all run float32."""
    return (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)


# ---- the whole ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="the device the steps run on: cuda[:n] or cpu")
    parser.add_argument("--attention", default="triton", help="the attention backend under test (it must run)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    problems = []
    if device.type == "cuda" and not torch.cuda.is_available():
        problems.append(f"--device {args.device}: this torch {torch.__version__} sees no CUDA device")
    print("\n".join(versions(device)))

    failures = import_modules(STEP_MODULES)
    imported = f"{len(STEP_MODULES) - len(failures)} of {len(STEP_MODULES)}"
    print(f"imported the steps' modules: {imported} ({len(repository_modules())} modules of the repository's)")
    problems += [f"import {failure}" for failure in failures]

    pins = carried_wheels()
    carried = carried_packages(pins)
    print("carried wheels (bench/gpu_wheels.sh), as this interpreter finds them:")
    print("\n".join(finding.line() for finding in carried))
    problems += [f"carried {f.what}: {f.detail}" for f in carried if not f.ok]
    image = image_packages()
    in_use = loaded_distributions() - set(pins)
    print(
        "the image's packages in use: "
        + ", ".join(f"{n} {importlib.metadata.version(n)}" for n in sorted(in_use & set(image)))
    )
    if elsewhere := sorted(in_use - set(image)):
        print(f"loaded, neither carried nor in the image (optional imports of other packages?): {', '.join(elsewhere)}")

    apis = api_findings(args.attention)
    print("APIs the steps call:")
    print("\n".join(finding.line() for finding in apis))
    problems += [f"{f.what}: {f.detail}" for f in apis if f.required and not f.ok]

    dtypes = step_dtypes(device)
    choices = attention_choices(device, dtypes)
    print("\n".join(render_choices(choices, device)))
    if args.attention not in ATTENTION_BACKENDS:
        problems.append(f"--attention {args.attention}: no such backend ({', '.join(ATTENTION_BACKENDS)})")
    for dtype in dtypes if args.attention in ATTENTION_BACKENDS else ():
        chosen = choices[(args.attention, dtype)]
        if chosen != args.attention:
            problems.append(
                f"the backend under test, {args.attention}, at {str(dtype).removeprefix('torch.')}: {chosen}"
            )

    seconds = time.perf_counter() - started
    if problems:
        print(f"preflight FAILED in {seconds:.1f} s; no step would measure what it names:")
        print("\n".join(f"  - {problem}" for problem in problems))
        return 1
    print(f"preflight ok in {seconds:.1f} s: {args.attention}, the backend under test, runs on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
