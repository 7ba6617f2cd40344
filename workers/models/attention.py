"""Paged attention: how the packed queries of a step meet the keys and values of their requests in the KV pool.

A query at position p sees the keys at positions p - window < position <= p when its layer has a sliding
window (`window` keys, its own included: the convention of `transformers`), else every key up to p. Keys a
window has left behind are not even gathered: an input attends from the first block its window reaches.

This is the `gather` attention backend (`workers.models.backends` chooses); the paged-cpu backend reuses its
prompt-chunk half.
Decoding inputs (one token each) attend in a few padded batches of similar lengths (`DecodeGroup`); each
longer input (a prompt chunk) attends on its own, over the keys and values just computed when it starts
its prompt, else over its blocks. A plan is built once per step for every window the model's layers use,
so a layer only looks its window up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from workers.models.step import StepInput

Window = int | None  # how many keys back a layer's queries see, their own included; None: all of them
# (keys 0 or values 1, a layer's pool, block tables [batch, n]) → [batch, kv_heads, n * block_size, dim]
Gather = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor, window: Window) -> torch.Tensor:
    """Which keys each query may see: positions broadcast against each other ([..., queries, 1] and
    [..., keys]) into a bool mask."""
    mask = key_positions <= query_positions
    if window is not None:
        mask &= key_positions > query_positions - window
    return mask


def first_visible_block(position: int, window: Window, block_size: int) -> int:
    """The first block holding a key that a query at `position` (or any later one) may see."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def sample_rows_of(inputs: list[StepInput]) -> list[int]:
    """The packed rows whose logits the step samples: each input's last `num_logits` rows."""
    rows: list[int] = []
    row = 0
    for step in inputs:
        row += len(step.token_ids)
        rows.extend(range(row - step.num_logits, row))
    return rows


class AttentionPlan:
    """Where each input of a step sits in the packed rows and which keys its queries attend over."""

    def __init__(
        self,
        inputs: list[StepInput],
        block_size: int,
        device: torch.device,
        buffers: GatherBuffers,
        group_cost: float,
        windows: tuple[Window, ...],
    ) -> None:
        self._gather = buffers.gather
        self.sample_rows = sample_rows_of(inputs)
        decoding, chunks = split_inputs(inputs, block_size)
        self._decode_groups = {
            window: _decode_groups(decoding, window, block_size, device, group_cost) for window in windows
        }
        self._chunks = prompt_chunks_of(chunks, windows, block_size, device)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_kv: torch.Tensor,
        scale: float,
        window: Window,
    ) -> torch.Tensor:
        """query [tokens, heads, head_dim], the step's own key and value [tokens, kv_heads, head_dim], the
        layer's pool [2, blocks, block_size, kv_heads, head_dim] → [tokens, heads * head_dim]."""
        out = torch.empty_like(query)
        for group in self._decode_groups[window]:
            out[group.rows] = group.attend(query, layer_kv, scale, self._gather)
        attend_prompt_chunks(self._chunks[window], out, query, key, value, layer_kv, scale, self._gather)
        return out.view(query.shape[0], -1)


Decoding = tuple[int, int, list[int]]  # (row, position, its block ids up to the position's)
Chunk = tuple[int, int, int, list[int]]  # (row, length, start, block ids up to its last token's)


def split_inputs(inputs: list[StepInput], block_size: int) -> tuple[list[Decoding], list[Chunk]]:
    """The step's decoding inputs (one token each) and its longer ones (prompt chunks), where they sit."""
    decoding: list[Decoding] = []
    chunks: list[Chunk] = []
    row = 0
    for step in inputs:
        length = len(step.token_ids)
        blocks = step.block_ids[: (step.start + length - 1) // block_size + 1]
        if length == 1:
            decoding.append((row, step.start, blocks))
        else:
            chunks.append((row, length, step.start, blocks))
        row += length
    return decoding, chunks


def prompt_chunks_of(
    chunks: list[Chunk], windows: tuple[Window, ...], block_size: int, device: torch.device
) -> dict[Window, list[_PromptChunk]]:
    return {window: [_PromptChunk.of(*chunk, window, block_size, device) for chunk in chunks] for window in windows}


def attend_prompt_chunks(
    chunks: list[_PromptChunk],
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_kv: torch.Tensor,
    scale: float,
    gather: Gather,
) -> None:
    """Each prompt chunk's queries attended into its rows of `out`, one SDPA call each."""
    for chunk in chunks:
        q = query[chunk.rows].transpose(0, 1)[None]
        if chunk.tables is None:
            keys, values = key[chunk.rows].transpose(0, 1)[None], value[chunk.rows].transpose(0, 1)[None]
        else:
            keys = gather(0, layer_kv[0], chunk.tables)[:, :, : chunk.keys]
            values = gather(1, layer_kv[1], chunk.tables)[:, :, : chunk.keys]
        attended = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True
        )
        out[chunk.rows] = attended[0].transpose(0, 1)


@dataclass
class _PromptChunk:
    rows: slice
    tables: torch.Tensor | None  # [1, blocks] to gather keys from; None: it starts its prompt, its own keys suffice
    keys: int  # how many keys it attends over (gathered from the first of its tables' blocks)
    mask: torch.Tensor | None  # [length, keys]: which keys each query sees; None: causal

    @classmethod
    def of(
        cls,
        row: int,
        length: int,
        start: int,
        block_ids: list[int],
        window: Window,
        block_size: int,
        device: torch.device,
    ) -> _PromptChunk:
        rows = slice(row, row + length)
        queries = torch.arange(start, start + length)[:, None]
        if start == 0:
            mask = None if window is None else visible(queries, torch.arange(length)[None], window).to(device)
            return cls(rows, None, length, mask)
        first = first_visible_block(start, window, block_size)
        keys = torch.arange(first * block_size, start + length)
        tables = torch.tensor(block_ids[first:], dtype=torch.long, device=device)[None]
        return cls(rows, tables, len(keys), visible(queries, keys[None], window).to(device))


# What a padded decode batch costs per layer beyond its blocks, in blocks' worth of gathering and
# attending: a call to index_select and one to SDPA for keys and values (measured on CPU, 100M model).
GROUP_COST_IN_BLOCKS = 32


def group_bounds(widths: list[int], group_cost: float = GROUP_COST_IN_BLOCKS) -> list[tuple[int, int]]:
    """Splits decoding inputs, sorted by their number of blocks, into consecutive groups so that the
    blocks gathered (each group padded to its widest) plus a fixed cost per group are fewest: one long
    context no longer pads every short one to its length."""
    count = len(widths)
    best = [0.0] + [float("inf")] * count  # best[end]: the cheapest grouping of widths[:end]
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        for first in range(end):
            cost = best[first] + group_cost + (end - first) * widths[end - 1]
            if cost < best[end]:
                best[end], cut[end] = cost, first
    bounds, end = [], count
    while end:
        bounds.append((cut[end], end))
        end = cut[end]
    return bounds[::-1]


def _decode_groups(
    decoding: list[Decoding],
    window: Window,
    block_size: int,
    device: torch.device,
    group_cost: float,
) -> list[DecodeGroup]:
    entries = []  # (row, position, first block, the blocks from it)
    for row, position, blocks in decoding:
        first = first_visible_block(position, window, block_size)
        entries.append((row, position, first, blocks[first:]))
    entries.sort(key=lambda entry: len(entry[3]))
    return [
        DecodeGroup.of(entries[first:end], window, block_size, device)
        for first, end in group_bounds([len(entry[3]) for entry in entries], group_cost)
    ]


@dataclass
class DecodeGroup:
    rows: torch.Tensor | slice  # the inputs' rows in the step
    tables: torch.Tensor  # [batch, widest] block ids, padded
    mask: torch.Tensor  # [batch, 1, 1, widest * block_size]: which gathered keys each input sees

    def attend(self, query: torch.Tensor, layer_kv: torch.Tensor, scale: float, gather: Gather) -> torch.Tensor:
        """query [tokens, heads, head_dim] → the group's rows attended [batch, heads, head_dim]."""
        keys, values = gather(0, layer_kv[0], self.tables), gather(1, layer_kv[1], self.tables)
        q = query[self.rows].unsqueeze(2)  # [batch, heads, 1, dim]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True)
        return attended[:, :, 0]

    @classmethod
    def of(
        cls, entries: list[tuple[int, int, int, list[int]]], window: Window, block_size: int, device: torch.device
    ) -> DecodeGroup:
        """entries: (row, position, first block gathered, the block ids from it) per input."""
        width = max(len(blocks) for *_, blocks in entries)
        tables = torch.tensor([blocks + [0] * (width - len(blocks)) for *_, blocks in entries], dtype=torch.long)
        positions = torch.tensor([position for _, position, _, _ in entries])[:, None]
        firsts = torch.tensor([first for _, _, first, _ in entries])[:, None]
        keys = firsts * block_size + torch.arange(width * block_size)[None]
        mask = visible(positions, keys, window)
        rows = torch.tensor([row for row, *_ in entries])
        return cls(rows.to(device), tables.to(device), mask[:, None, None, :].to(device))


class GatherBuffers:
    """Memory that gathered keys (0) and values (1) are copied into, kept from step to step: fresh
    megabytes every layer would cost page faults on the order of the copy itself."""

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self._buffers = [torch.empty(0, *block_shape, dtype=dtype, device=device) for _ in (0, 1)]

    def gather(self, which: int, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """pool [blocks, block_size, kv_heads, dim], tables [batch, n] → [batch, kv_heads, n * block_size,
        dim], a view valid until the next gather into the same buffer."""
        batch, width = tables.shape
        buffer = self._buffers[which]
        if buffer.shape[0] < batch * width:
            buffer = torch.empty(2 * batch * width, *buffer.shape[1:], dtype=buffer.dtype, device=buffer.device)
            self._buffers[which] = buffer
        gathered = buffer[: batch * width]
        torch.index_select(pool, 0, tables.reshape(-1), out=gathered)  # far faster than pool[tables] on CPU
        return _as_heads(gathered, tables)


def gather_fresh(_which: int, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """As GatherBuffers.gather, into new memory: a captured graph must own every buffer it uses."""
    return _as_heads(torch.index_select(pool, 0, tables.reshape(-1)), tables)


def _as_heads(gathered: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch * n, block_size, kv_heads, dim] → [batch, kv_heads, n * block_size, dim]."""
    batch, width = tables.shape
    return gathered.view(batch, width * gathered.shape[1], gathered.shape[2], gathered.shape[3]).transpose(1, 2)
