"""Every step replayed from a CUDA graph: prompt chunks and decoding rows alike.

A step's whole forward pass launches a few hundred kernels; on a GPU, launching them one by one from
Python takes longer than running them. With the Triton attention backend every kernel of a step reads
its indices from the runner's `StepBuffers` (fixed addresses) and its shapes depend only on the number of
rows, so one graph per row count captures any mix: a step is padded to the smallest captured row count
that holds it (`capture_row_counts`), its inputs are loaded into the buffers (one copy), and the graph
replays. The padding rows write their keys and values into the pool's padding block and belong to no
sequence. The logits come from a fixed number of rows per graph (the sampled rows, then row 0 repeated),
and the step keeps its own. A step the graphs do not hold (more rows, inputs or blocks than captured, or
more sampled rows than a graph computes) runs eagerly from the same buffers.

Without capture (`capture=False`: the CPU, where the tests run it) the same padded steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import torch

from workers.runner.step_buffers import StepBuffers, StepView

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from workers.models.step import StepInput

log = logging.getLogger(__name__)


class BufferedRunner(Protocol):
    """What the graphs need of their runner (`ModelRunner`)."""

    config: PretrainedConfig
    device: torch.device
    step_buffers: StepBuffers

    def forward_view(self, view: StepView, logit_rows: torch.Tensor) -> torch.Tensor: ...


def capture_row_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, multiples of 8 to 64, of 16 to 256, of 32 beyond, and max_tokens: a step of 32 rows or
    more pads by a quarter of its rows at most."""
    counts = {1, 2, 4, *range(8, 65, 8), *range(80, 257, 16), *range(288, max_tokens, 32), max_tokens}
    return sorted(count for count in counts if count <= max_tokens)


def logit_row_count(rows: int, max_seqs: int) -> int:
    """How many rows' logits a graph of `rows` rows computes: one per sequence at most, as a step
    without drafts samples."""
    return min(rows, max_seqs)


class StepGraphs:
    def __init__(self, runner: BufferedRunner, capture: bool) -> None:
        self._runner = runner
        buffers = runner.step_buffers
        self.row_counts = capture_row_counts(buffers.max_tokens)
        self.capturing = capture and runner.device.type == "cuda"
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._max_seqs = buffers.max_seqs
        # which rows' logits a graph computes: the step's sampled rows, then row 0
        self._logit_rows = torch.zeros(logit_row_count(buffers.max_tokens, buffers.max_seqs), dtype=torch.long)
        self._logit_rows = self._logit_rows.to(runner.device)

    def rows_for(self, inputs: list[StepInput]) -> int | None:
        """The captured row count the step pads to, or None when no graph holds it."""
        tokens = sum(len(step.token_ids) for step in inputs)
        sampled = sum(step.num_logits for step in inputs)
        if not inputs or tokens > self.row_counts[-1]:
            return None
        rows = next(count for count in self.row_counts if count >= tokens)
        if sampled > logit_row_count(rows, self._max_seqs) or not self._runner.step_buffers.fits(inputs, rows):
            return None
        return rows

    @torch.inference_mode()
    def run(self, inputs: list[StepInput], rows: int) -> torch.Tensor:
        """Runs a step `rows_for` holds; float32 logits [its sampled rows, vocab] on the device (a copy:
        the next replay overwrites the graph's own)."""
        view = self._runner.step_buffers.load(inputs, rows)
        logit_rows = self._logit_rows[: logit_row_count(rows, self._max_seqs)]
        logit_rows.zero_()
        logit_rows[: view.num_sampled].copy_(view.sample_rows)
        if self.capturing:
            self._graphs[rows].replay()
            logits = self._outputs[rows]
        else:
            logits = self._runner.forward_view(_bounded(view, rows), logit_rows)
        return logits[: view.num_sampled].clone()

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per row count, largest first (the smaller ones reuse its memory), each over a step of
        padding rows only."""
        if not self.capturing:
            return
        pool = torch.cuda.graph_pool_handle()
        started = time.monotonic()
        for done, rows in enumerate(reversed(self.row_counts), 1):
            self._graphs[rows] = self._capture_one(rows, pool)
            if done % 8 == 0 or done == len(self.row_counts):
                log.info(
                    "captured %d of %d step graphs (%.1f s)", done, len(self.row_counts), time.monotonic() - started
                )

    def _capture_one(self, rows: int, pool: torch.cuda._POOL_HANDLE) -> torch.cuda.CUDAGraph:
        runner, device = self._runner, self._runner.device
        view = _bounded(runner.step_buffers.load([], rows), rows)
        logit_rows = self._logit_rows[: logit_row_count(rows, self._max_seqs)]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            runner.forward_view(view, logit_rows)  # compiles the kernels, sets up library handles and workspaces
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._outputs[rows] = runner.forward_view(view, logit_rows)
        return graph


def _bounded(view: StepView, rows: int) -> StepView:
    """The view with the attention kernel's bounds of a graph of `rows` rows, which hold for every step it
    replays: no sequence has more rows than the graph, nor more keys than its block table holds."""
    view.max_query_len, view.max_seq_len = rows, view.max_keys
    return view
