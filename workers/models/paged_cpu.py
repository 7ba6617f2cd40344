"""The `paged-cpu` attention backend: decoding rows attend over the paged pool in place through one C++
operator call per layer (`csrc/paged_decode.cpp`, its rows spread over torch's OpenMP threads), with no
gathered copy, no padding and no mask; prompt chunks attend as the `gather` backend has them
(their keys gathered once, `scaled_dot_product_attention`'s blocked kernels, which long prompts need).

The operator is compiled on first use with the machine's C++ compiler and cached on disk (torch's
extension cache, keyed by the source and the flags), so a worker pays the compile once per machine.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.models.attention import (
    GatherBuffers,
    Window,
    attend_prompt_chunks,
    prompt_chunks_of,
    sample_rows_of,
    split_inputs,
)

if TYPE_CHECKING:
    from workers.models.step import StepInput

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


def _cpu_flags() -> list[str]:
    """Vector instructions this machine has (the operator is built for and run on the same machine)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []


_FLAGS = ["-O3", "-fopenmp", *_cpu_flags()]
_NAME = "diptych_paged_decode_" + hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:12]


def built_library() -> Path:
    """Where the operator's shared library is built (torch's extension cache, TORCH_EXTENSIONS_DIR)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / _NAME / f"{_NAME}.so"


@functools.cache
def _load() -> str | None:
    """Builds (or finds built) and loads the operator; None when it is loaded, else why it cannot be."""
    library = built_library()
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(library.parent):
            if library.exists():
                _load_built(library)
            else:
                _build(library)
    except Exception as error:
        return f"its C++ operator could not be built here: {error}"
    return None


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One process of the machine builds at a time. An flock, which the kernel lets go when its holder
    dies: torch's own lock is a file that a worker killed mid-build leaves behind, and every later
    worker then waits for it for ever."""
    with open(directory / "diptych.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_built(library: Path) -> None:
    try:
        torch.ops.load_library(str(library))
    except OSError as error:  # a build cut short can leave a library that does not load: built again
        log.warning("the paged-cpu operator at %s does not load (%s); building it again", library, error)
        library.unlink()
        _build(library)


def _build(library: Path) -> None:
    from torch.utils import cpp_extension

    log.info("building the paged-cpu attention operator (once per machine, in about 20 seconds)")
    (library.parent / "lock").unlink(missing_ok=True)  # torch's lock of a killed build: nobody else builds now
    cpp_extension.load(
        name=_NAME,
        sources=[str(_SOURCE)],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],  # the process's OpenMP runtime: torch's own libgomp.so.1, already loaded
        build_directory=str(library.parent),
        is_python_module=False,
        verbose=False,
    )


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why paged-cpu cannot run on this device and dtype, or None when it can."""
    if device.type != "cpu":
        return f"paged-cpu runs on the CPU, not on {device.type}"
    if dtype != torch.float32:
        return f"paged-cpu runs float32 pools, not {dtype}"
    return _load()


class PagedCpuPlan:
    """Every decoding row of a step in one operator call per layer; prompt chunks as the gather plan has them."""

    def __init__(
        self, inputs: list[StepInput], block_size: int, buffers: GatherBuffers, windows: tuple[Window, ...]
    ) -> None:
        self._gather = buffers.gather
        self.sample_rows = sample_rows_of(inputs)
        decoding, chunks = split_inputs(inputs, block_size)
        self._chunks = prompt_chunks_of(chunks, windows, block_size, torch.device("cpu"))
        starts = [0]
        for _, _, blocks in decoding:
            starts.append(starts[-1] + len(blocks))
        self._rows = torch.tensor([row for row, _, _ in decoding], dtype=torch.long)
        self._positions = torch.tensor([position for _, position, _ in decoding], dtype=torch.long)
        self._starts = torch.tensor(starts, dtype=torch.long)
        self._blocks = torch.tensor([block for _, _, blocks in decoding for block in blocks], dtype=torch.long)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_kv: torch.Tensor,
        scale: float,
        window: Window,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        attend_prompt_chunks(self._chunks[window], out, query, key, value, layer_kv, scale, self._gather)
        if self._rows.numel():
            torch.ops.diptych.paged_decode(
                query.contiguous(),
                layer_kv[0],
                layer_kv[1],
                out,
                self._rows,
                self._positions,
                self._starts,
                self._blocks,
                scale,
                window or 0,
            )
        return out.view(query.shape[0], -1)


def main() -> int:
    """Builds the operator ahead of any worker (the image build runs `python -m workers.models.paged_cpu`) and
    says whether it is ready or why not; either way exits 0, since gather serves where it cannot run."""
    reason = unavailable_reason(torch.device("cpu"), torch.float32)
    print(f"paged-cpu attention: {reason}" if reason else "paged-cpu attention operator built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
