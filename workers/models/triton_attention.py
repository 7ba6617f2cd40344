"""The `triton` attention backend: the whole step, prompt chunks and decoding rows together, in one Triton
kernel launch per layer, reading keys and values where they lie in the paged pool through int32 block tables.
It exists for the GPU machine, whose torch (2.11) ships a `varlen_attn` that reads no block tables.

A program attends one tile of one sequence's queries for one kv head: up to `BLOCK_Q` consecutive queries
times the kv head's group of query heads, as the rows of one matrix, so grouped-query (and multi-query)
heads read each key once for their group. It walks the sequence's keys `TILE_N` at a time, looking each
key's block up in the block table (any block size), scores them with `tl.dot` and keeps an online softmax
in float32 (exp2, the scale folded with log2(e)). A sequence's queries are the last positions of its keys
(`seq_lens`): a chunk's query i sits at `seq_len - chunk + i` and sees the keys up to its own, and with a
sliding window of w keys only those after `position - w` (the convention of `workers.models.attention`).
Keys a tile's window has left behind are never read.

Which program takes which tile depends on the step's shapes alone, so a launch can be captured in a CUDA
graph and replayed over other contents: the grid holds `tokens // BLOCK_Q + max_seqs` tiles per kv head,
enough for any split of the tokens into sequences (sequence s owns tiles `query_start[s] // BLOCK_Q + s`
onwards), and each program finds its sequence by a binary search of `query_start` on the device; tiles past
their sequence's queries, and padding sequences (no query rows), return at once. Nothing is read on the host.

Split-KV (flash-decoding): when a step's tiles alone would leave most of the GPU's multiprocessors idle and
its contexts are long, as with a few decoding rows over thousands of keys, each tile's keys are cut into
`num_splits` segments attended in parallel (a third grid axis), each writing its normalised output and its
log-sum-exp to float32 scratch; a second kernel merges the segments of each row. `kv_splits` holds the rule.

On the CPU the kernels run under Triton's interpreter when TRITON_INTERPRET=1 was set before this module
(and triton) was first imported: the tests do, so every CPU run checks the kernel itself. `auto` never
picks it there (the interpreter is far too slow to serve).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from workers.models.attention import Window, sample_rows_of
from workers.models.device_values import on_device

if TYPE_CHECKING:
    from workers.models.step import StepInput

try:
    import triton
    import triton.language as tl
except ImportError as error:  # a machine without triton still imports the module; unavailable_reason says why
    triton = None
    _IMPORT_ERROR: str | None = str(error)
else:
    _IMPORT_ERROR = None
# whether the kernels below are made for Triton's interpreter: triton reads TRITON_INTERPRET as they are defined
INTERPRETED = triton is not None and triton.knobs.runtime.interpret

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_N = 32  # keys a program scores per iteration
MAX_BLOCK_M = 64  # query rows (queries x the group's heads) a prompt chunk's tile holds at most
# Split-KV: a segment takes at least this many keys (shorter, and the merge costs more than the parallelism
# brings), a tile is cut into at most MAX_SPLITS, and the interpreter plans for an H200's multiprocessors.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16
INTERPRETED_MULTIPROCESSORS = 132


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the backend cannot run a pool on `device` of `dtype`; None when it can."""
    if triton is None:
        return f"triton is not installed ({_IMPORT_ERROR})"
    if dtype not in DTYPES:
        return f"the triton kernel takes float16, bfloat16 or float32, not {dtype}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"triton runs on CUDA devices, and this torch {torch.__version__} has none"
        if INTERPRETED:
            return "the triton kernels were made for the interpreter (TRITON_INTERPRET=1), not for the GPU"
        return None
    if device.type == "cpu":
        if INTERPRETED:
            return None
        return "triton runs on CUDA devices; on the CPU only under its interpreter (TRITON_INTERPRET=1, for tests)"
    return f"triton runs on CUDA devices, not {device.type}"


class TritonPlan:
    """A step's attention metadata on the device; `attend` is one kernel launch per layer. `of` builds it
    for a step's inputs; a runner replaying CUDA graphs makes it over its persistent step buffers
    (`workers.runner.step_buffers`), whose addresses the graphs captured."""

    def __init__(
        self,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        sample_rows: list[int] | None = None,
    ) -> None:
        self.query_start, self.seq_lens, self.block_table = query_start, seq_lens, block_table
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        self.sample_rows = sample_rows or []

    @classmethod
    def of(cls, inputs: list[StepInput], block_size: int, device: torch.device) -> TritonPlan:
        lengths = [len(step.token_ids) for step in inputs]
        keys = [step.start + length for step, length in zip(inputs, lengths, strict=True)]
        width = max(-(-count // block_size) for count in keys)
        tables = [step.block_ids[:width] + [0] * (width - len(step.block_ids[:width])) for step in inputs]
        return cls(
            on_device([0, *accumulate(lengths)], device, torch.int32),
            on_device(keys, device, torch.int32),
            on_device(tables, device, torch.int32),
            max(lengths),
            max(keys),
            sample_rows_of(inputs),
        )

    def attend(
        self,
        query: torch.Tensor,
        _key: torch.Tensor,  # the step's own keys and values, in the pool already
        _value: torch.Tensor,
        layer_kv: torch.Tensor,
        scale: float,
        window: Window,
    ) -> torch.Tensor:
        """query [tokens, heads, head_dim], the layer's pool [2, blocks, block_size, kv_heads, head_dim]
        (this step's keys and values already in it) → [tokens, heads * head_dim]."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        paged_attention(
            query,
            layer_kv[0],
            layer_kv[1],
            out,
            self.query_start,
            self.seq_lens,
            self.block_table,
            scale,
            window,
            self.max_query_len,
            self.max_seq_len,
        )
        return out.view(query.shape[0], -1)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    window: Window,
    max_query_len: int,
    max_seq_len: int,
) -> None:
    """Attends every sequence's query rows over its keys in the pool, into `out`, in one launch (two with
    split-KV). query and out [tokens, heads, head_dim]; key_cache and value_cache [blocks, block_size,
    kv_heads, head_dim]; query_start int32 [max_seqs + 1] (cumulative rows; padding sequences repeat the
    last offset); seq_lens int32 [max_seqs] (keys each sequence attends over, 0 for padding);
    block_table int32 [max_seqs, width]; window None or the keys a query sees, its own included;
    max_query_len and max_seq_len upper bounds. Rows past query_start[-1] are left alone. The launch
    depends on shapes and these Python values only, never on the tensors' contents (CUDA graphs replay
    it), and reads nothing back to the host."""
    tiles = Tiles.of(query, key_cache, max_query_len)
    programs = tiles.count(query.shape[0], seq_lens.shape[0]) * key_cache.shape[2]
    splits = kv_splits(programs, max_seq_len, _multiprocessors(query.device))
    launch_paged_attention(
        query, key_cache, value_cache, out, query_start, seq_lens, block_table, scale, window, max_query_len, splits
    )


def kv_splits(programs: int, max_seq_len: int, multiprocessors: int) -> int:
    """How many segments each tile's keys are cut into (the split-KV rule): 1 while the step's programs
    (tiles x kv heads) fill the GPU's multiprocessors; else as many as bring them up to about two per
    multiprocessor, each segment keeping MIN_KEYS_PER_SPLIT of the longest context's keys or more, at most
    MAX_SPLITS, rounded down to a power of two (a kernel is compiled per count)."""
    if programs >= multiprocessors:
        return 1
    wanted = min(MAX_SPLITS, -(-2 * multiprocessors // programs), max_seq_len // MIN_KEYS_PER_SPLIT)
    return 1 << (wanted.bit_length() - 1) if wanted >= 2 else 1


def launch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    window: Window,
    max_query_len: int,
    num_splits: int,
) -> None:
    """`paged_attention` with the number of key segments per tile given (1: no split, no merge)."""
    tokens, heads, head_dim = query.shape
    max_seqs, kv_heads = seq_lens.shape[0], key_cache.shape[2]
    _check(query, key_cache, value_cache, out, query_start, seq_lens, block_table, num_splits)
    tiles = Tiles.of(query, key_cache, max_query_len)
    if num_splits > 1:
        partial_out = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=query.device)
    else:  # never touched: the kernel writes `out` itself
        partial_out, partial_lse = out, out
    _attention_kernel[(tiles.count(tokens, max_seqs), kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        partial_out,
        partial_lse,
        query_start,
        seq_lens,
        block_table,
        scale * math.log2(math.e),
        *query.stride()[:2],
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        *out.stride()[:2],
        block_table.stride(0),
        max_seqs,
        SEARCH_STEPS=(max_seqs - 1).bit_length(),
        GROUP=heads // kv_heads,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE_N=TILE_N,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=tiles.head_dim_padded,
        BLOCK_SIZE=key_cache.shape[1],
        WINDOW=window or 0,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # tf32 applies to float32 only
        INTERPRETED=INTERPRETED,
        UPCAST_DOT=INTERPRETED and query.dtype == torch.bfloat16,
    )
    if num_splits > 1:
        _merge_splits_kernel[(tokens, heads)](
            out,
            partial_out,
            partial_lse,
            query_start,
            *out.stride()[:2],
            max_seqs,
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=tiles.head_dim_padded,
        )


@dataclass(frozen=True)
class Tiles:
    """A launch's tile shape, from shapes alone: BLOCK_M matrix rows, BLOCK_Q queries times the group's heads."""

    block_q: int
    block_m: int
    head_dim_padded: int  # tl.arange spans a power of two

    @classmethod
    def of(cls, query: torch.Tensor, key_cache: torch.Tensor, max_query_len: int) -> Tiles:
        _, heads, head_dim = query.shape
        group = heads // key_cache.shape[2]
        # tl.dot takes 16 rows at least; a prompt chunk's tile grows to MAX_BLOCK_M rows (or one group's heads)
        block_m = max(16, triton.next_power_of_2(group))
        block_m = max(block_m, min(MAX_BLOCK_M, triton.next_power_of_2(max(max_query_len, 1) * group)))
        return cls(block_m // group, block_m, max(16, triton.next_power_of_2(head_dim)))

    def count(self, tokens: int, max_seqs: int) -> int:
        """Tiles enough for any split of `tokens` rows into `max_seqs` sequences: sequence s owns those
        from query_start[s] // block_q + s, each of its own that ends a run of tokens // block_q."""
        return tokens // self.block_q + max_seqs


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_splits: int,
) -> None:
    """Shapes, dtypes and layouts the kernel relies on (nothing of the tensors' contents)."""
    heads, kv_heads, max_seqs = query.shape[1], key_cache.shape[2], seq_lens.shape[0]
    problems = []
    if heads % kv_heads or key_cache.shape != value_cache.shape or out.shape != query.shape:
        problems.append(f"query {tuple(query.shape)}, pools {tuple(key_cache.shape)} and out do not fit together")
    if not query.dtype == key_cache.dtype == value_cache.dtype == out.dtype:
        problems.append("query, pools and out have one dtype")
    if query_start.shape != (max_seqs + 1,) or block_table.shape[0] != max_seqs:
        problems.append(f"query_start holds max_seqs + 1 = {max_seqs + 1} offsets, block_table max_seqs rows")
    if any(t.dtype != torch.int32 for t in (query_start, seq_lens, block_table)):
        problems.append("query_start, seq_lens and block_table are int32")
    if any(t.stride(-1) != 1 for t in (query, key_cache, value_cache, out, query_start, seq_lens, block_table)):
        problems.append("every tensor's last dimension is contiguous")
    if num_splits < 1 or num_splits & (num_splits - 1):
        problems.append(f"num_splits is a power of two, not {num_splits}")
    if problems:
        raise ValueError("paged_attention: " + "; ".join(problems))


_MULTIPROCESSORS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (cached: asking the driver is no cheaper than a launch)."""
    if device.type != "cuda":
        return INTERPRETED_MULTIPROCESSORS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


if triton is not None:

    @triton.jit(do_not_specialize=["num_seqs"])  # a step's sequence count changes all the time: one kernel
    def _attention_kernel(
        query,
        key_cache,
        value_cache,
        out,
        partial_out,
        partial_lse,
        query_start,
        seq_lens,
        block_table,
        scale_log2,
        stride_query_token,
        stride_query_head,
        stride_key_block,
        stride_key_slot,
        stride_key_head,
        stride_value_block,
        stride_value_slot,
        stride_value_head,
        stride_out_token,
        stride_out_head,
        stride_table,
        num_seqs,
        SEARCH_STEPS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        WINDOW: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        INTERPRETED: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        # the sequence this tile belongs to: the last s whose first tile, query_start[s] // BLOCK_Q + s, is <= tile
        low = tile * 0
        high = low + num_seqs
        for _ in tl.static_range(SEARCH_STEPS):
            middle = (low + high) // 2
            reached = tl.load(query_start + middle) // BLOCK_Q + middle <= tile
            low = tl.where(reached, middle, low)
            high = tl.where(reached, high, middle)
        seq = low
        first_row = tl.load(query_start + seq)
        query_len = tl.load(query_start + seq + 1) - first_row
        first_query = (tile - first_row // BLOCK_Q - seq) * BLOCK_Q  # within the sequence's queries
        if first_query >= query_len:
            return
        seq_len = tl.load(seq_lens + seq)
        context = seq_len - query_len  # the keys before the chunk

        rows = tl.arange(0, BLOCK_M)
        query_index = first_query + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
        token = first_row + query_index
        positions = context + query_index
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        q = tl.load(
            query + token[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )

        key_end = context + tl.minimum(first_query + BLOCK_Q, query_len)  # one past the tile's last position
        if WINDOW > 0:  # noqa: SIM108 - a constexpr branch, taken when the kernel compiles: kept a statement
            key_begin = tl.maximum(context + first_query - WINDOW + 1, 0) // TILE_N * TILE_N
        else:
            key_begin = key_end * 0
        if NUM_SPLITS > 1:
            segment = tl.cdiv(tl.cdiv(key_end - key_begin, TILE_N), NUM_SPLITS) * TILE_N
            key_begin = key_begin + split * segment
            key_end = tl.minimum(key_end, key_begin + segment)

        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
        table = block_table + seq * stride_table
        key_base = key_cache + kv_head * stride_key_head
        value_base = value_cache + kv_head * stride_value_head
        if INTERPRETED:  # the interpreter's range() takes no tensors (numpy 2 turns no 1-element array into an int)
            tile_start = key_begin
            while tile_start < key_end:
                top, total, acc = _attend_key_tile(
                    tile_start, key_end, q, top, total, acc, table, key_base, value_base, positions, dims,
                    dim_valid, scale_log2, stride_key_block, stride_key_slot, stride_value_block,
                    stride_value_slot, TILE_N, BLOCK_SIZE, WINDOW, DOT_PRECISION, UPCAST_DOT,
                )  # fmt: skip
                tile_start += TILE_N
        else:
            for tile_start in range(key_begin, key_end, TILE_N):
                top, total, acc = _attend_key_tile(
                    tile_start, key_end, q, top, total, acc, table, key_base, value_base, positions, dims,
                    dim_valid, scale_log2, stride_key_block, stride_key_slot, stride_value_block,
                    stride_value_slot, TILE_N, BLOCK_SIZE, WINDOW, DOT_PRECISION, UPCAST_DOT,
                )  # fmt: skip

        attended = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        store_mask = row_valid[:, None] & dim_valid[None, :]
        if NUM_SPLITS == 1:
            tl.store(
                out + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
                attended.to(out.dtype.element_ty),
                mask=store_mask,
            )
        else:
            partial_row = (token * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
            tl.store(partial_out + partial_row[:, None] * HEAD_DIM + dims[None, :], attended, mask=store_mask)
            lse = tl.where(total == 0.0, float("-inf"), top + tl.math.log2(tl.where(total == 0.0, 1.0, total)))
            tl.store(partial_lse + partial_row, lse, mask=row_valid)

    @triton.jit
    def _attend_key_tile(
        tile_start,
        key_end,
        q,
        top,
        total,
        acc,
        table,
        key_base,
        value_base,
        positions,
        dims,
        dim_valid,
        scale_log2,
        stride_key_block,
        stride_key_slot,
        stride_value_block,
        stride_value_slot,
        TILE_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        WINDOW: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        """The online softmax (running row maxima `top`, sums `total`, weighted values `acc`) carried over
        the keys tile_start .. tile_start + TILE_N, each read from its block in the pool."""
        keys = tile_start + tl.arange(0, TILE_N)
        key_valid = keys < key_end
        blocks = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = keys % BLOCK_SIZE
        k = tl.load(
            key_base + blocks[None, :] * stride_key_block + slots[None, :] * stride_key_slot + dims[:, None],
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        scores = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * scale_log2
        seen = key_valid[None, :] & (keys[None, :] <= positions[:, None])
        if WINDOW > 0:
            seen = seen & (keys[None, :] > positions[:, None] - WINDOW)
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that has seen no key yet
        weights = tl.math.exp2(scores - shift[:, None])
        rescale = tl.math.exp2(top - shift)
        v = tl.load(
            value_base + blocks[:, None] * stride_value_block + slots[:, None] * stride_value_slot + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        acc = acc * rescale[:, None] + _dot(weights.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        return new_top, total * rescale + tl.sum(weights, 1), acc

    @triton.jit
    def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        if UPCAST:  # the interpreter multiplies bfloat16 as raw bits; in float32 the products are the same, exact
            product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            product = tl.dot(a, b, input_precision=DOT_PRECISION)
        return product

    @triton.jit(do_not_specialize=["num_seqs"])
    def _merge_splits_kernel(
        out,
        partial_out,
        partial_lse,
        query_start,
        stride_out_token,
        stride_out_head,
        num_seqs,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        if token >= tl.load(query_start + num_seqs):  # a padding row: left alone
            return
        first = (token * tl.num_programs(1) + head) * NUM_SPLITS
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        lse = tl.load(partial_lse + first + splits)
        weights = tl.math.exp2(lse - tl.max(lse, 0))  # an empty segment (lse -inf) weighs nothing
        segments = tl.load(
            partial_out + (first + splits)[:, None] * HEAD_DIM + dims[None, :], mask=dim_valid[None, :], other=0.0
        )
        merged = tl.sum(segments * weights[:, None], 0) / tl.sum(weights, 0)
        tl.store(
            out + token * stride_out_token + head * stride_out_head + dims,
            merged.to(out.dtype.element_ty),
            mask=dim_valid,
        )
