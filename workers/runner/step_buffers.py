"""A step's inputs in memory kept from step to step, written in place.

Every index a step needs — each token's id, position and slot in the KV pool, where each input's rows
start (`query_start`), how many keys each input attends over (`seq_lens`), its block table, and which rows
get logits — lives in one int32 buffer on the device, laid out in fixed sections, so that a CUDA graph
captured once reads each step's values from the same addresses. The host writes the step into a mirror of
it (pinned, two of them used in turn, so that a step's copy is never overwritten before it has been
made), with numpy views and no tensor per input; a request's block table row is written only where it
grew, as long as it keeps its row from one step to the next; then the whole mirror crosses in one
copy that does not wait for the device. On the CPU the buffer is the mirror itself.

Rows past a step's tokens (a graph's padding) read token 0 at position 0 and write their keys and values
into the pool's padding block; sequences past the step's inputs have no rows and no keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from workers.models.step import StepInput


@dataclass
class StepView:
    """One step's inputs in a StepBuffers' device buffer: views valid until the buffers load the next step."""

    num_tokens: int  # the step's own rows; the views below may hold padding rows after them
    num_seqs: int
    token_ids: torch.Tensor  # [rows] int32
    positions: torch.Tensor  # [rows] int32
    slots: torch.Tensor  # [rows] int64: each row's slot in the pool, counted over the blocks' slots
    query_start: torch.Tensor  # [max_seqs + 1] int32: where each sequence's rows start; then the end, repeated
    seq_lens: torch.Tensor  # [max_seqs] int32: keys each sequence attends over (0 past the step's inputs)
    block_table: torch.Tensor  # [max_seqs, max_blocks] int32
    sample_rows: torch.Tensor  # [sampled rows] int32: the rows whose logits the step samples, in input order
    num_sampled: int
    max_query_len: int  # bounds for the attention kernel: the step's own, or its graph's
    max_seq_len: int
    max_keys: int  # the keys a block table row holds: max_blocks * block_size


class StepBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        block_size: int,
        padding_block: int,
        device: torch.device,
    ) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self._block_size = block_size
        self._padding_slot = padding_block * block_size
        sizes = {
            "token_ids": max_tokens,
            "positions": max_tokens,
            "slots": max_tokens,
            "sample_rows": max_tokens,
            "query_start": max_seqs + 1,
            "seq_lens": max_seqs,
            "block_table": max_seqs * max_blocks,
        }
        self._sections: dict[str, slice] = {}
        offset = 0
        for name, size in sizes.items():
            self._sections[name] = slice(offset, offset + size)
            offset += size
        on_cuda = device.type == "cuda"
        self._device_buffer = torch.zeros(offset, dtype=torch.int32, device=device)
        hosts = [torch.zeros(offset, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2 if on_cuda else 1)]
        if not on_cuda:
            hosts = [self._device_buffer]
        self._hosts = [_HostMirror(host, self._sections, max_seqs, max_blocks, padding_block) for host in hosts]
        self._copied = [torch.cuda.Event() if on_cuda else None for _ in hosts]
        self._turn = 0
        self._device_views = {name: self._device_buffer[section] for name, section in self._sections.items()}
        # int64 for index_copy_, kept in place so that a graph reads the step's slots from one address
        self._slots = torch.zeros(max_tokens, dtype=torch.long, device=device)

    def fits(self, inputs: list[StepInput], rows: int) -> bool:
        """Whether a step of these inputs padded to `rows` rows fits the buffers."""
        if len(inputs) > self.max_seqs or rows > self.max_tokens:
            return False
        size = self._block_size
        return all((step.start + len(step.token_ids) - 1) // size < self.max_blocks for step in inputs)

    def load(self, inputs: list[StepInput], rows: int | None = None) -> StepView:
        """Writes the step into the device buffer (padded to `rows` rows, default its own) and returns
        its views. The caller checked `fits`."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._hosts)
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()  # the copy two steps back read this mirror: it is long done by now
        host = self._hosts[turn]
        written = host.write(inputs, self._block_size, self._padding_slot, rows)
        if host.buffer is not self._device_buffer:
            self._device_buffer.copy_(host.buffer, non_blocking=True)
            assert copied is not None
            copied.record()
        views = self._device_views
        padded = written.rows
        self._slots[:padded].copy_(views["slots"][:padded])
        return StepView(
            num_tokens=written.tokens,
            num_seqs=len(inputs),
            token_ids=views["token_ids"][:padded],
            positions=views["positions"][:padded],
            slots=self._slots[:padded],
            query_start=views["query_start"],
            seq_lens=views["seq_lens"],
            block_table=views["block_table"].view(self.max_seqs, self.max_blocks),
            sample_rows=views["sample_rows"][: written.sampled],
            num_sampled=written.sampled,
            max_query_len=written.max_query_len,
            max_seq_len=written.max_seq_len,
            max_keys=self.max_blocks * self._block_size,
        )


@dataclass
class _Written:
    tokens: int
    rows: int
    sampled: int
    max_query_len: int
    max_seq_len: int


class _HostMirror:
    """One host copy of the buffer, with numpy views of its sections and what its block table rows hold."""

    def __init__(
        self, buffer: torch.Tensor, sections: dict[str, slice], max_seqs: int, max_blocks: int, padding_block: int
    ) -> None:
        self.buffer = buffer
        array = buffer.numpy()
        self._token_ids = array[sections["token_ids"]]
        self._positions = array[sections["positions"]]
        self._slots = array[sections["slots"]]
        self._sample_rows = array[sections["sample_rows"]]
        self._query_start = array[sections["query_start"]]
        self._seq_lens = array[sections["seq_lens"]]
        self._tables = array[sections["block_table"]].reshape(max_seqs, max_blocks)
        self._tables[:] = padding_block
        # per row: the request's block table it was last written from (StepInput.table), and how many ids it holds
        self._row_source: list[object | None] = [None] * max_seqs
        self._row_length = [0] * max_seqs

    def write(self, inputs: list[StepInput], block_size: int, padding_slot: int, rows: int | None) -> _Written:
        row = sampled = max_query_len = max_seq_len = 0
        for index, step in enumerate(inputs):
            length = len(step.token_ids)
            end = step.start + length
            self._write_table_row(index, step, (end - 1) // block_size + 1)
            self._query_start[index] = row
            self._seq_lens[index] = end
            if length == 1:
                position = step.start
                self._token_ids[row] = step.token_ids[0]
                self._positions[row] = position
                self._slots[row] = self._tables[index, position // block_size] * block_size + position % block_size
            else:
                span = np.arange(step.start, end, dtype=np.int32)
                self._token_ids[row : row + length] = step.token_ids
                self._positions[row : row + length] = span
                self._slots[row : row + length] = (
                    self._tables[index, span // block_size] * block_size + span % block_size
                )
            row += length
            for logit_row in range(row - step.num_logits, row):
                self._sample_rows[sampled] = logit_row
                sampled += 1
            max_query_len, max_seq_len = max(max_query_len, length), max(max_seq_len, end)
        padded = row if rows is None else rows
        self._token_ids[row:padded] = 0
        self._positions[row:padded] = 0
        self._slots[row:padded] = padding_slot
        self._query_start[len(inputs) :] = row
        self._seq_lens[len(inputs) :] = 0
        return _Written(row, padded, sampled, max_query_len, max_seq_len)

    def _write_table_row(self, index: int, step: StepInput, needed: int) -> None:
        """Row `index` holds the first `needed` of the input's block ids: only those it lacks are written
        when the row last held the same request's table (which only grows while the request holds it)."""
        same = step.table is not None and self._row_source[index] is step.table
        held = self._row_length[index] if same else 0
        if needed > held:
            self._tables[index, held:needed] = step.block_ids[held:needed]
        self._row_source[index] = step.table
        self._row_length[index] = max(held, needed)
