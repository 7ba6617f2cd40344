"""KV blocks between the pool and the tier: copied out of the pool as bytes (one entry per block), and
bytes fetched from the tier as the tensor the runner writes into the pool.

A block's bytes are its slice of the pool, [layers, 2 (keys, values), block_size, kv_heads, head_dim], in
the pool's dtype: a namespace (`tier_namespace`) names the model and that layout, so bytes are only read
back by a worker whose pool has the same shape.
"""

from dataclasses import dataclass

import torch

from workers.runner.kv_pool import KvLayout, KvPool


@dataclass
class TierKv:
    """Blocks a request fetched from the tier before it was queued: blocks first_block.. of its prompt."""

    first_block: int
    block_hashes: list[int]
    data: torch.Tensor  # [layers, 2, len(block_hashes), block_size, kv_heads, head_dim], host memory

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def tier_namespace(model: str, layout: KvLayout) -> str:
    """The tier's name for blocks of this model in this KV layout."""
    dtype = str(layout.dtype).removeprefix("torch.")
    return (
        f"{model}/layers={layout.num_layers},kv_heads={layout.kv_heads},head_dim={layout.head_dim},"
        f"block_size={layout.block_size},dtype={dtype}"
    )


def copy_blocks_out(runner: KvPool, block_ids: list[int]) -> list[bytes]:
    """The blocks' bytes, every kv head (a tensor-parallel runner gathers its ranks'), copied out of the pool
    on the forward thread: the pool may overwrite them later."""
    lay = runner.layout
    out = torch.empty(lay.num_layers, 2, len(block_ids), lay.block_size, lay.kv_heads, lay.head_dim, dtype=lay.dtype)
    runner.read_blocks(block_ids, out)
    blocks = out.permute(2, 0, 1, 3, 4, 5).contiguous()
    as_bytes = blocks.view(torch.uint8) if blocks.dtype.itemsize > 1 else blocks
    return [as_bytes[i].numpy().tobytes() for i in range(len(block_ids))]


def blocks_from_bytes(blocks: list[bytes], layout: KvLayout) -> torch.Tensor:
    """Blocks' bytes as [layers, 2, len(blocks), block_size, kv_heads, head_dim] (one copy, into a buffer
    the tensor then views)."""
    size = layout.block_nbytes
    joined = bytearray(size * len(blocks))
    view = memoryview(joined)
    for index, data in enumerate(blocks):
        view[index * size : (index + 1) * size] = data
    flat = torch.frombuffer(joined, dtype=layout.dtype).view(len(blocks), *layout.block_shape)
    return flat.permute(1, 2, 0, 3, 4, 5)
