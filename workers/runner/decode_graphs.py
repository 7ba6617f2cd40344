"""Decode steps replayed from CUDA graphs.

On a GPU a decode step of a small model is shorter than the time Python takes to launch its few hundred
kernels one by one. So a step in which every input decodes one token is padded to the next captured
batch size and block-table width, and its whole forward pass (`ModelRunner.decode_padded`) is replayed
from a graph captured at start-up: one host-to-device copy of the step's indices, one replay; the logits stay on the
device for sampling. Padding rows write their keys and values into the runner's `padding_block` and
attend to it alone. Steps with prompt chunks, or with more rows or longer block tables than were
captured, run eagerly.

The runner builds its graphs itself from a `DecodeGraphSpec`. Without capture (`capture=False`: CPU,
where the tests run it) the same padded step runs eagerly from the same buffers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from workers.runner.kv_pool import KvLayout

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from workers.models.step import StepInput

log = logging.getLogger(__name__)


class PaddedRunner(Protocol):
    """What the graphs need of their runner (`ModelRunner`): its pool's shape and padding block, and the
    fixed-shape decode step they capture."""

    config: PretrainedConfig
    device: torch.device
    layout: KvLayout
    padding_block: int

    def decode_padded(self, batch: torch.Tensor) -> torch.Tensor: ...


# The columns of a padded decode batch before the block table: token, position, slot block, slot offset
# (see ModelRunner.decode_padded).
PADDED_COLUMNS = 4


@dataclass(frozen=True)
class DecodeGraphSpec:
    """The steps a runner pads and replays: up to `max_batch` inputs (decoding rows), block tables up to
    `max_blocks`; with the triton attention backend, steps of up to `max_tokens` rows of any mix
    (`workers.runner.step_graphs`; 0: `max_batch`)."""

    max_batch: int
    max_blocks: int
    # True: capture CUDA graphs, on CUDA devices only (elsewhere the runner pads nothing and runs steps eagerly);
    # False: run the padded steps eagerly from the same buffers, on any device (how the CPU tests run them).
    capture: bool = True
    max_tokens: int = 0


def capture_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_batch."""
    return sorted({size for size in (1, 2, 4) if size < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


def capture_widths(max_blocks: int) -> list[int]:
    """Powers of two, then max_blocks: a step's block tables are padded to less than twice their width."""
    widths = [1]
    while widths[-1] * 2 < max_blocks:
        widths.append(widths[-1] * 2)
    return sorted(set(widths) | {max_blocks})


def _smallest_at_least(sizes: list[int], needed: int) -> int:
    return next(size for size in sizes if size >= needed)


class DecodeGraphs:
    """A runner's padded decode steps (built by the runner from its DecodeGraphSpec); `capture()` records
    the graphs, `run()` replays them."""

    def __init__(self, runner: PaddedRunner, spec: DecodeGraphSpec) -> None:
        self._runner = runner
        self.batch_sizes = capture_batch_sizes(spec.max_batch)
        self.widths = capture_widths(spec.max_blocks)
        self.capturing = spec.capture
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._padding_row = [0, 0, runner.padding_block, 0] + [runner.padding_block] * self.widths[-1]
        columns = len(self._padding_row)
        rows = spec.max_batch
        self._host = torch.empty(rows, columns, dtype=torch.long, pin_memory=self.capturing)
        self._batch = torch.empty(rows, columns, dtype=torch.long, device=runner.device)
        self._logits = torch.empty(rows, runner.config.vocab_size, dtype=torch.float32, device=runner.device)
        self._max_tokens = self.widths[-1] * runner.layout.block_size

    def covers(self, inputs: list[StepInput]) -> bool:
        """Whether the step decodes one token per input within the captured batch sizes and widths."""
        return 0 < len(inputs) <= self.batch_sizes[-1] and all(
            len(s.token_ids) == 1 and s.sample and s.start < self._max_tokens for s in inputs
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per batch size and width, largest first: the smaller ones reuse its memory."""
        if not self.capturing:
            return
        self._batch.copy_(torch.tensor([self._padding_row] * self._batch.shape[0]))  # warm-ups touch padding only
        pool = torch.cuda.graph_pool_handle()
        shapes = [(batch, width) for batch in reversed(self.batch_sizes) for width in reversed(self.widths)]
        started = time.monotonic()
        for done, (batch, width) in enumerate(shapes, 1):
            self._graphs[batch, width] = self._capture_one(batch, width, pool)
            if done % 16 == 0 or done == len(shapes):
                log.info("captured %d of %d decode graphs (%.1f s)", done, len(shapes), time.monotonic() - started)

    @torch.inference_mode()
    def run(self, inputs: list[StepInput]) -> torch.Tensor:
        """Runs a covered step; returns float32 logits [len(inputs), vocab] on the device (a copy: the
        next replay overwrites the graph's own)."""
        count, size = len(inputs), self._runner.layout.block_size
        batch = _smallest_at_least(self.batch_sizes, count)
        width = _smallest_at_least(self.widths, max(s.start // size + 1 for s in inputs))
        padding_row = self._padding_row[: PADDED_COLUMNS + width]
        rows = []
        for s in inputs:
            block = s.start // size  # the block of the token's slot, and the last the row attends over
            table = s.block_ids[: block + 1]
            rows.append(
                [
                    s.token_ids[0],
                    s.start,
                    table[-1],
                    s.start % size,
                    *table,
                    *padding_row[PADDED_COLUMNS + len(table) :],
                ]
            )
        rows += [padding_row] * (batch - count)
        self._host[:batch, : PADDED_COLUMNS + width] = torch.tensor(rows)
        self._batch[:batch].copy_(self._host[:batch], non_blocking=True)
        if self.capturing:
            self._graphs[batch, width].replay()
        else:
            self._step(batch, width)
        return self._logits[:count].clone()

    def _step(self, batch: int, width: int) -> None:
        self._logits[:batch].copy_(self._runner.decode_padded(self._batch[:batch, : PADDED_COLUMNS + width]))

    def _capture_one(self, batch: int, width: int, pool: torch.cuda._POOL_HANDLE) -> torch.cuda.CUDAGraph:
        device = self._runner.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._step(batch, width)  # a first run sets up what a capture may not (library handles, workspaces)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._step(batch, width)
        return graph
