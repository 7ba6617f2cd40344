"""Runs the model over paged KV: one forward pass per engine step, whatever mix of prompt chunks and
decoding tokens the scheduler chose.

The KV of every layer lives in one pool tensor shaped [layers, 2 (keys, values), blocks, block_size,
kv_heads, head_dim]. A step packs the new tokens of all scheduled requests into one row, runs the
decoder layers' own modules (norms, projections, rotary embedding, MLP) on it, writes each new token's
keys and values into its slot of the pool, and attends over each request's blocks. Only the rows
whose logits are sampled go through the final norm and the LM head.

The pool holds one block more than the KV cache manager hands out (`padding_block`): the padded rows
of a fixed-shape decode step (`decode_padded`, which `workers.decode_graphs` captures) write there.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from workers.projections import LayerProjections, Projection


@dataclass
class StepInput:
    """One request's part of a step: tokens at positions start.. of the request, over its blocks."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: bool


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def token_nbytes(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.block_size * self.token_nbytes


def kv_layout_of(config, block_size: int, dtype: torch.dtype) -> KvLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KvLayout(config.num_hidden_layers, kv_heads, head_dim, block_size, dtype)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: str = "cpu") -> None:
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        dtype = next(model.parameters()).dtype
        self.layout = kv_layout_of(self.config, block_size, dtype)
        lay = self.layout
        self.num_blocks = num_blocks
        self.padding_block = num_blocks
        self.kv = torch.zeros(
            lay.num_layers, 2, num_blocks + 1, block_size, lay.kv_heads, lay.head_dim, dtype=dtype, device=self.device
        )
        self.num_heads = self.config.num_attention_heads
        self._gather_buffers = _GatherBuffers(self.kv.shape[3:], dtype, self.device)
        self._layers = [LayerProjections.of(layer) for layer in model.model.layers]
        self._lm_head = Projection(model.lm_head)
        self.decode_group_cost = GROUP_COST_IN_BLOCKS  # math.inf: every decoding input in one padded batch
        self.decode_graphs = None  # a workers.decode_graphs.DecodeGraphs, which then runs the steps it covers

    @torch.inference_mode()
    def execute(self, inputs: list[StepInput]) -> torch.Tensor:
        """Runs one step; returns float32 logits [number of sampling inputs, vocab], in input order."""
        if self.decode_graphs is not None and self.decode_graphs.covers(inputs):
            return self.decode_graphs.run(inputs)
        token_ids = torch.tensor([t for step in inputs for t in step.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s.start, s.start + len(s.token_ids)) for s in inputs])
        slot_blocks, slot_offsets = self._slots(inputs, positions)
        plan = _AttentionPlan(inputs, self.layout.block_size, self.device, self._gather_buffers, self.decode_group_cost)
        hidden = self._forward(token_ids.to(self.device), positions.to(self.device), slot_blocks, slot_offsets, plan.attend)
        rows = plan.sample_rows
        if not rows:
            return torch.empty(0, self.config.vocab_size)
        return self._logits(hidden[rows]).cpu()

    @torch.inference_mode()
    def decode_padded(self, batch: torch.Tensor) -> torch.Tensor:
        """One decoding token per row, as fixed shapes and device tensors only (what a CUDA graph can
        capture). batch [rows, PADDED_COLUMNS + width] on the device holds, per row, the token, its
        position, its slot's block and offset, the length it attends over, then its block table
        (padding rows: `padding_block` everywhere, length 1). Returns float32 logits [rows, vocab]."""
        token_ids, positions, slot_blocks, slot_offsets, lengths = batch[:, :PADDED_COLUMNS].unbind(1)
        tables = batch[:, PADDED_COLUMNS:]
        keys = torch.arange(tables.shape[1] * self.layout.block_size, device=batch.device)
        group = _DecodeGroup(slice(None), tables, (keys[None, :] < lengths[:, None])[:, None, None, :])

        def attend(query, key, value, layer_kv, scale):
            return group.attend(query, layer_kv, scale, _gather_fresh).reshape(batch.shape[0], -1)

        return self._logits(self._forward(token_ids, positions, slot_blocks, slot_offsets, attend))

    def _forward(self, token_ids, positions, slot_blocks, slot_offsets, attend) -> torch.Tensor:
        """The decoder layers over packed tokens (device tensors); returns hidden states [tokens, hidden]."""
        base = self.model.model
        hidden = base.embed_tokens(token_ids).unsqueeze(0)
        cos, sin = base.rotary_emb(hidden, positions.unsqueeze(0))
        for layer_index, (layer, weights) in enumerate(zip(base.layers, self._layers)):
            residual = hidden
            attn = layer.self_attn
            query, key, value = self._project(attn, weights, layer.input_layernorm(hidden), cos, sin)
            layer_kv = self.kv[layer_index]
            layer_kv[0, slot_blocks, slot_offsets] = key[0].transpose(0, 1)
            layer_kv[1, slot_blocks, slot_offsets] = value[0].transpose(0, 1)
            attended = attend(query[0], key[0], value[0], layer_kv, attn.scaling)
            hidden = residual + weights.o(attended.unsqueeze(0))
            hidden = hidden + weights.mlp(layer.post_attention_layernorm(hidden))
        return hidden[0]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(self.model.model.norm(hidden)).float()

    def _project(self, attn, weights: LayerProjections, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        shape = (*hidden.shape[:-1], -1, self.layout.head_dim)
        query, key, value = (x.view(shape) for x in weights.qkv.split(hidden))
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        return query, key, value.transpose(1, 2)

    def _slots(self, inputs: list[StepInput], positions: torch.Tensor):
        size = self.layout.block_size
        tables = torch.cat([
            torch.tensor(s.block_ids, dtype=torch.long)[torch.arange(s.start, s.start + len(s.token_ids)) // size]
            for s in inputs
        ])
        return tables.to(self.device), (positions % size).to(self.device)

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copies blocks into `out` [layers, 2, len(block_ids), block_size, kv_heads, head_dim] (host)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.device.type == "cpu":
            torch.index_select(self.kv, 2, index, out=out)
        else:
            out.copy_(torch.index_select(self.kv, 2, index), non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()

    def block_views(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes in pool memory, in the order read_blocks would copy them (layer, keys then
        values, block), each run of consecutive blocks as one view. Host-memory pools only."""
        runs, start = [], 0
        for index in range(1, len(block_ids) + 1):
            if index == len(block_ids) or block_ids[index] != block_ids[index - 1] + 1:
                runs.append((block_ids[start], block_ids[index - 1] + 1))
                start = index
        return [
            memoryview(self.kv[layer, kind, first:end].numpy()).cast("B")
            for layer in range(self.layout.num_layers) for kind in (0, 1) for first, end in runs
        ]

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv.index_copy_(2, index, data.to(self.device, non_blocking=True))


class _AttentionPlan:
    """How a step's packed queries meet the KV of their requests. Decoding inputs (one token each)
    attend in a few padded batches of similar lengths (`decode_groups`); each longer input (a prompt
    chunk) attends on its own, over the keys and values just computed when it starts the prompt, else
    over its blocks."""

    def __init__(
        self, inputs: list[StepInput], block_size: int, device: torch.device, buffers: "_GatherBuffers",
        group_cost: float,
    ) -> None:
        self._buffers = buffers
        self.sample_rows: list[int] = []
        decoding: list[tuple[int, int, list[int]]] = []  # (row, length, block ids)
        self.chunks: list[tuple[int, int, int, torch.Tensor]] = []  # (row, length, start, block ids)
        row = 0
        for step in inputs:
            length = len(step.token_ids)
            if step.sample:
                self.sample_rows.append(row + length - 1)
            if length == 1:
                decoding.append((row, step.start + 1, step.block_ids[: -(-(step.start + 1) // block_size)]))
            else:
                blocks = torch.tensor(step.block_ids[: -(-(step.start + length) // block_size)], device=device)
                self.chunks.append((row, length, step.start, blocks))
            row += length
        decoding.sort(key=lambda d: d[1])
        self.decode_groups = [
            _DecodeGroup.of(decoding[first:end], block_size, device)
            for first, end in _group_bounds([len(blocks) for _, _, blocks in decoding], group_cost)
        ]

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """query [heads, tokens, head_dim], the step's own key and value [kv_heads, tokens, head_dim]
        → [tokens, heads * head_dim]."""
        heads, tokens, head_dim = query.shape
        out = torch.empty(tokens, heads, head_dim, dtype=query.dtype, device=query.device)
        gather = self._buffers.gather
        for group in self.decode_groups:
            out[group.rows] = group.attend(query, layer_kv, scale, gather)
        for row, length, start, blocks in self.chunks:
            q = query[None, :, row:row + length]
            if start == 0:
                keys, values = key[None, :, row:row + length], value[None, :, row:row + length]
                attended = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                keys = gather(0, layer_kv[0], blocks[None])[:, :, : start + length]
                values = gather(1, layer_kv[1], blocks[None])[:, :, : start + length]
                mask = torch.arange(start + length, device=q.device)[None, :] <= (
                    start + torch.arange(length, device=q.device)[:, None]
                )
                attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            out[row:row + length] = attended[0].transpose(0, 1)
        return out.reshape(tokens, heads * head_dim)


# What a padded decode batch costs per layer beyond its blocks, in blocks' worth of gathering and
# attending: a call to index_select and one to SDPA for keys and values (measured on CPU, 100M model).
GROUP_COST_IN_BLOCKS = 32


def _group_bounds(widths: list[int], group_cost: float = GROUP_COST_IN_BLOCKS) -> list[tuple[int, int]]:
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


# The columns of a padded decode batch before the block table: token, position, slot block, slot
# offset, length attended over (see ModelRunner.decode_padded).
PADDED_COLUMNS = 5


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | slice  # the inputs' rows in the step
    tables: torch.Tensor        # [batch, widest] block ids, padded
    mask: torch.Tensor          # [batch, 1, 1, widest * block_size]: which keys are the input's own

    def attend(self, query: torch.Tensor, layer_kv: torch.Tensor, scale: float, gather) -> torch.Tensor:
        """query [heads, tokens, head_dim] → the group's rows attended [batch, heads, head_dim]."""
        keys, values = gather(0, layer_kv[0], self.tables), gather(1, layer_kv[1], self.tables)
        q = query[:, self.rows].transpose(0, 1).unsqueeze(2)  # [batch, heads, 1, dim]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True)
        return attended[:, :, 0]

    @classmethod
    def of(cls, decoding: list[tuple[int, int, list[int]]], block_size: int, device: torch.device) -> "_DecodeGroup":
        width = max(len(blocks) for _, _, blocks in decoding)
        tables = torch.tensor([blocks + [0] * (width - len(blocks)) for _, _, blocks in decoding], dtype=torch.long)
        lengths = torch.tensor([length for _, length, _ in decoding])
        mask = torch.arange(width * block_size)[None, :] < lengths[:, None]
        rows = torch.tensor([row for row, _, _ in decoding])
        return cls(rows.to(device), tables.to(device), mask[:, None, None, :].to(device))


class _GatherBuffers:
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


def _gather_fresh(which: int, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """As _GatherBuffers.gather, into new memory: a captured graph must own every buffer it uses."""
    return _as_heads(torch.index_select(pool, 0, tables.reshape(-1)), tables)


def _as_heads(gathered: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch * n, block_size, kv_heads, dim] → [batch, kv_heads, n * block_size, dim]."""
    batch, width = tables.shape
    return gathered.view(batch, width * gathered.shape[1], gathered.shape[2], gathered.shape[3]).transpose(1, 2)
