"""The KV pool as the rest of the worker sees it: its layout, and the few block operations the KV
connectors and the shared KV tier use to move blocks in and out (`KvPool`). The model runner owns the pool
and implements the protocol; a tensor-parallel leader implements it over its group's shards. The pool
a prefill worker's host-memory pool is registered with its own NIXL agent to write chunks from (a local
registration); a decode worker's pool never is: KV reaches it through registered receive buffers
(workers/kv_connector/nixl.py says why)."""

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedConfig


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


def kv_layout_of(config: PreTrainedConfig, block_size: int, dtype: torch.dtype) -> KvLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KvLayout(config.num_hidden_layers, kv_heads, head_dim, block_size, dtype)


@dataclass
class BlocksRead:
    """A copy of blocks out of the pool, under way: `wait` returns once its `out` holds them. On a GPU the
    copy runs on a stream of its own, from blocks gathered in the step's stream order (a later step may
    overwrite the blocks; the gathered copy stays), into pinned memory: `out` itself where it is pinned,
    else a pinned bounce buffer that `wait` copies into `out`. Elsewhere the copy is done already."""

    done: torch.cuda.Event | None = None
    bounce: torch.Tensor | None = None
    out: torch.Tensor | None = None

    def wait(self) -> None:
        if self.done is None:
            return
        self.done.synchronize()
        self.done = None
        if self.bounce is not None and self.out is not None:
            self.out.copy_(self.bounce)
            self.bounce = None


class KvSource(Protocol):
    """Blocks out of a worker's KV pool (what a sending path reads). Block data is laid out
    [layers, 2 (keys, values), blocks, block_size, kv_heads, head_dim], in `layout.dtype`."""

    @property
    def layout(self) -> KvLayout: ...

    @property
    def supports_block_views(self) -> bool:
        """Whether `block_views` can show blocks in place (a whole pool in host memory)."""
        ...

    def read_blocks(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copies the blocks into `out` (host memory)."""
        ...

    def start_reading_blocks(self, block_ids: list[int], out: torch.Tensor) -> BlocksRead:
        """Starts copying the blocks into `out` (host memory) without waiting for the device: the calling
        thread (the forward thread) goes on; whoever reads `out` waits on the result first."""
        ...

    def block_views(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes in place, in `read_blocks`'s order; only where `supports_block_views`."""
        ...

    def pool_memory(self) -> torch.Tensor:
        """The whole pool, which `block_views` point into (to register it with NIXL); only where
        `supports_block_views`."""
        ...


class KvPool(KvSource, Protocol):
    """Blocks in and out of a worker's KV pool."""

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Writes `data` (as `read_blocks` lays it out) into the blocks."""
        ...
