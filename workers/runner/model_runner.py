"""Runs the model over paged KV: one forward pass per engine step, whatever mix of prompt chunks and
decoding tokens the scheduler chose.

The runner owns the step's mechanics: it packs the new tokens of all scheduled requests into one row,
computes each token's slot in the KV pool, hands the row to the model's decoder (`workers.models`: the
family's embedding, projections, rotary embedding, norms and MLP, built once at start), writes each
layer's new keys and values into their slots, attends over each request's blocks through a plan made once
per step (`workers.models.attention`), and sends only the rows whose logits are sampled through the final
norm and the LM head.

The KV of every layer lives in one pool tensor shaped [layers, 2 (keys, values), blocks, block_size,
kv_heads, head_dim] (on one rank of a tensor-parallel group, the rank's own kv heads). The pool holds
one block more than the KV cache manager hands out (`padding_block`): the padded rows of a fixed-shape
decode step (`decode_padded`, which the runner's `DecodeGraphs` capture on CUDA) write there.
"""

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from workers.models.attention import GROUP_COST_IN_BLOCKS as GROUP_COST_IN_BLOCKS  # bench.step_costs imports it here
from workers.models.attention import (
    AttentionPlan,
    DecodeGroup,
    GatherBuffers,
    Window,
    gather_fresh,
    visible,
)
from workers.models.backends import StepAttention, choose_backend
from workers.models.decoder import DecoderLayer
from workers.models.device_values import on_device
from workers.models.families import decoder_of
from workers.models.flash_varlen import FlashVarlenPlan
from workers.models.paged_cpu import PagedCpuPlan
from workers.models.sharding import Shard, check_sharded, with_all_reduce
from workers.models.step import StepInput
from workers.models.triton_attention import TritonPlan
from workers.runner.decode_graphs import PADDED_COLUMNS, DecodeGraphs, DecodeGraphSpec
from workers.runner.kv_pool import BlocksRead, kv_layout_of
from workers.runner.step_buffers import StepBuffers, StepView
from workers.runner.step_graphs import StepGraphs

# (query, the step's own key and value, the layer's pool, scale, window) → the attended rows, as StepAttention.attend
AttendStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, Window], torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        decode_graphs: DecodeGraphSpec | None = None,
        shard: Shard | None = None,
        attention: str = "auto",
    ) -> None:
        """`decode_graphs`: pad steps to those shapes and replay them from CUDA graphs captured here (on CUDA
        devices; elsewhere only with `capture=False`, which runs the padded steps eagerly): with the triton
        attention backend every step up to the spec's `max_tokens` (`StepGraphs`), else decode steps only
        (`DecodeGraphs`).
        `shard`: this runner is one rank of a tensor-parallel group (`workers.runner.tensor_parallel`), over a
        model that `workers.models.sharding.shard_model` cut down to the rank's heads and MLP units.
        `attention`: the attention backend (`workers.models.backends`)."""
        self.config = model.config
        self.decoder = decoder_of(model)  # raises UnsupportedModelError for an architecture it cannot run
        self.device = torch.device(device)
        dtype = next(model.parameters()).dtype
        self.layout = kv_layout_of(self.config, block_size, dtype)  # all kv heads: KV as it crosses workers
        self.attention_backend = choose_backend(attention, self.device, dtype, block_size)
        lay = self.layout
        self.shard = shard
        self.kv_heads = lay.kv_heads  # in this runner's pool: its shard's
        if shard is not None:
            if decode_graphs is not None:
                raise ValueError("a tensor-parallel runner runs its steps eagerly: ask for no decode graphs")
            check_sharded(self.decoder, self.config, shard.degree)
            self.decoder = with_all_reduce(self.decoder, shard.all_reduce)
            self.kv_heads = lay.kv_heads // shard.degree
        self.num_blocks = num_blocks
        self.padding_block = num_blocks
        self.kv = torch.zeros(
            lay.num_layers, 2, num_blocks + 1, block_size, self.kv_heads, lay.head_dim, dtype=dtype, device=self.device
        )
        self._gather_buffers = GatherBuffers(self.kv.shape[3:], dtype, self.device)
        self._copy_stream: torch.cuda.Stream | None = None  # KV copied out to the host (start_reading_blocks)
        self.decode_group_cost: float = GROUP_COST_IN_BLOCKS  # math.inf: every decoding input in one padded batch
        self.decode_graphs = None  # the DecodeGraphs that run the steps they cover, when the spec asks for them
        self.step_graphs: StepGraphs | None = None  # with the triton backend, instead of decode_graphs
        if decode_graphs is not None and (self.device.type == "cuda" or not decode_graphs.capture):
            if self.attention_backend == "triton":
                self.step_buffers = StepBuffers(
                    max(decode_graphs.max_tokens, decode_graphs.max_batch),
                    decode_graphs.max_batch,
                    decode_graphs.max_blocks,
                    block_size,
                    self.padding_block,
                    self.device,
                )
                self.step_graphs = StepGraphs(self, decode_graphs.capture)
                self.step_graphs.capture()
            else:
                self.decode_graphs = DecodeGraphs(self, decode_graphs)
                self.decode_graphs.capture()

    @torch.inference_mode()
    def execute(self, inputs: list[StepInput]) -> torch.Tensor:
        """Runs one step; returns float32 logits [sum of the inputs' num_logits, vocab] on the device, in
        input order (a sampling input's rows in position order)."""
        if self.step_graphs is not None and (padded_rows := self.step_graphs.rows_for(inputs)) is not None:
            return self.step_graphs.run(inputs, padded_rows)
        if self.decode_graphs is not None and self.decode_graphs.covers(inputs):
            return self.decode_graphs.run(inputs)
        token_ids, positions, slots = self._packed(inputs)
        plan = self._plan(inputs)
        hidden = self._forward(token_ids, positions, slots, plan.attend)
        rows = plan.sample_rows
        if not rows:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        return self.decoder.logits(hidden[on_device(rows, self.device)])

    def _plan(self, inputs: list[StepInput]) -> StepAttention:
        if self.attention_backend == "flash-varlen":
            return FlashVarlenPlan(inputs, self.layout.block_size, self.device)
        if self.attention_backend == "triton":
            return TritonPlan.of(inputs, self.layout.block_size, self.device)
        if self.attention_backend == "paged-cpu":
            return PagedCpuPlan(inputs, self.layout.block_size, self._gather_buffers, self.decoder.windows)
        return AttentionPlan(
            inputs,
            self.layout.block_size,
            self.device,
            self._gather_buffers,
            self.decode_group_cost,
            self.decoder.windows,
        )

    @torch.inference_mode()
    def decode_padded(self, batch: torch.Tensor) -> torch.Tensor:
        """One decoding token per row, as fixed shapes and device tensors only (what a CUDA graph can
        capture). batch [rows, PADDED_COLUMNS + width] on the device holds, per row, the token, its
        position, its slot's block and offset, then its block table (padding rows: position 0 and
        `padding_block` everywhere). Returns float32 logits [rows, vocab]."""
        token_ids, positions, slot_blocks, slot_offsets = batch[:, :PADDED_COLUMNS].unbind(1)
        slots = slot_blocks * self.layout.block_size + slot_offsets
        tables = batch[:, PADDED_COLUMNS:]
        keys = torch.arange(tables.shape[1] * self.layout.block_size, device=batch.device)[None, :]
        groups = {
            window: DecodeGroup(slice(None), tables, visible(positions[:, None], keys, window)[:, None, None, :])
            for window in self.decoder.windows
        }

        def attend(  # the step's own key and value are in the pool already: attention reads them there
            query: torch.Tensor,
            _key: torch.Tensor,
            _value: torch.Tensor,
            layer_kv: torch.Tensor,
            scale: float,
            window: Window,
        ) -> torch.Tensor:
            return groups[window].attend(query, layer_kv, scale, gather_fresh).reshape(batch.shape[0], -1)

        return self.decoder.logits(self._forward(token_ids, positions, slots, attend))

    @torch.inference_mode()
    def forward_view(self, view: StepView, logit_rows: torch.Tensor) -> torch.Tensor:
        """A step loaded into the runner's StepBuffers, attended by the triton kernel over the view's
        indices (what a CUDA graph captures: fixed addresses, shapes by row count); float32 logits of
        `logit_rows` [rows, vocab]."""
        attention = TritonPlan(view.query_start, view.seq_lens, view.block_table, view.max_query_len, view.max_seq_len)
        hidden = self._forward(view.token_ids, view.positions, view.slots, attention.attend)
        return self.decoder.logits(hidden.index_select(0, logit_rows))

    def _forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attend: AttendStep
    ) -> torch.Tensor:
        """The decoder over packed tokens (device tensors; `slots`: each token's slot in the pool, counted
        over its blocks' slots); returns hidden states [tokens, hidden]."""
        decoder = self.decoder
        hidden = decoder.embed(token_ids)
        cos, sin = decoder.rotary(hidden, positions)

        def attention(layer: DecoderLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            layer_kv = self.kv[layer.index]
            layer_kv[0].view(-1, *key.shape[1:]).index_copy_(0, slots, key)
            layer_kv[1].view(-1, *value.shape[1:]).index_copy_(0, slots, value)
            return attend(query, key, value, layer_kv, layer.scale, layer.window)

        for layer in decoder.layers:
            hidden = layer.forward(hidden, cos, sin, attention)
        return hidden

    def _packed(self, inputs: list[StepInput]) -> torch.Tensor:
        """The step's tokens packed in one row: their ids, positions, and each one's slot in the pool,
        built as Python lists (a tensor operation per input would cost more than the lists) and moved to
        the device in one copy; [3, tokens]."""
        size = self.layout.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for step in inputs:
            span = range(step.start, step.start + len(step.token_ids))
            token_ids += step.token_ids
            positions += span
            slots += [step.block_ids[position // size] * size + position % size for position in span]
        return on_device([token_ids, positions, slots], self.device)

    @property
    def supports_block_views(self) -> bool:
        """Whether `block_views` can show the blocks in place: a whole pool (every kv head) in host memory."""
        return self.device.type == "cpu" and self.shard is None

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copies blocks into `out` [layers, 2, len(block_ids), block_size, kv_heads, head_dim] (host; the
        pool's kv heads: on one rank of a tensor-parallel group, its own)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.device.type == "cpu":
            torch.index_select(self.kv, 2, index, out=out)
        else:
            out.copy_(torch.index_select(self.kv, 2, index), non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def start_reading_blocks(self, block_ids: list[int], out: torch.Tensor) -> BlocksRead:
        """As read_blocks, without waiting for the device (see BlocksRead)."""
        if self.device.type != "cuda":
            self.read_blocks(block_ids, out)
            return BlocksRead()
        gathered = torch.index_select(self.kv, 2, on_device(block_ids, self.device))
        target = out if out.is_pinned() else torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            target.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        gathered.record_stream(stream)  # its memory is not handed out again before the copy has read it
        return BlocksRead(done, None if target is out else target, out)

    def block_views(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes in pool memory, in the order read_blocks would copy them (layer, keys then
        values, block), each run of consecutive blocks as one view. Only where `supports_block_views`."""
        runs, start = [], 0
        for index in range(1, len(block_ids) + 1):
            if index == len(block_ids) or block_ids[index] != block_ids[index - 1] + 1:
                runs.append((block_ids[start], block_ids[index - 1] + 1))
                start = index
        return [
            self.kv[layer, kind, first:end].numpy().data.cast("B")
            for layer in range(self.layout.num_layers)
            for kind in (0, 1)
            for first, end in runs
        ]

    def pool_memory(self) -> torch.Tensor:
        return self.kv

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv.index_copy_(2, index, data.to(self.device, non_blocking=True))
