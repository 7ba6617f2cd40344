"""KV memory in fixed-size blocks: the block pool, per-request block tables, and the prefix cache.

A block holds `block_size` tokens of KV for every layer. A full block that was computed from a prompt is
named by the hash chain of diptych_common.prefix_hash; while named it can be shared by any request whose
tokens start the same way. A block nobody uses goes to the free queue, oldest first; a named block there
still serves prefix hits until it is handed out again (least recently used first).

Every request hashes its blocks under its cache salt (its organization), so blocks are shared only
between requests of one organization.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from diptych_common.prefix_hash import block_hash, chain_root


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    """Hands out blocks, counts their users, and keeps named blocks findable until they are reused."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.version = 0  # grows whenever the set of named blocks changes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[KVBlock]:
        """Fresh blocks for new tokens, least recently freed first; evicts their old names."""
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks needed, {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.version += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def share(self, blocks: Sequence[KVBlock]) -> None:
        """Adds a user to blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drops a user; blocks nobody uses become free. Give the blocks in the order they should be
        reused: a request's tail blocks go first, so its shared head stays cached longest."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def name(self, block: KVBlock, hash_value: int) -> None:
        if block.block_hash is not None or hash_value in self.cached:
            return  # already named, or an identical block is cached: keep the first
        block.block_hash = hash_value
        self.cached[hash_value] = block
        self.version += 1


@dataclass
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class KVCacheManager:
    """Owns the block pool and the block table of every request holding KV."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # names of each request's named full blocks, in order
        self.hits_tokens = 0
        self.queried_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Sequence[int], salt: str = "") -> PrefixHit:
        """The longest run of cached full blocks, named under `salt`, that starts `token_ids`, leaving at
        least the last token to compute (its logits give the next token)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        parent = chain_root(salt)
        usable = (len(token_ids) - 1) // self.block_size
        for index in range(usable):
            start = index * self.block_size
            parent = block_hash(parent, token_ids[start : start + self.block_size])
            block = self.pool.cached.get(parent)
            if block is None:
                break
            hit.blocks.append(block)
            hit.hashes.append(parent)
        return hit

    def record_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += num_tokens
        self.hits_tokens += hit_tokens

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grows the request's block table to hold `num_tokens`; a new request may start from a prefix
        hit. False, changing nothing, when there are not enough free blocks."""
        table = self.block_tables.get(request_id)
        if table is None:
            table = list(hit.blocks) if hit else []
            hashes = list(hit.hashes) if hit else []
        else:
            hashes = None
        needed = self.blocks_for(num_tokens) - len(table)
        reviving = sum(1 for b in (hit.blocks if hit and hashes is not None else []) if b.ref_count == 0)
        if needed > self.pool.num_free - reviving:
            return False
        if hashes is not None:
            self.pool.share(table)
            self.block_tables[request_id] = table
            self._hashes[request_id] = hashes
        if needed > 0:
            table.extend(self.pool.take(needed))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: str = "") -> None:
        """Names the request's blocks that are now full of computed tokens, under the request's `salt`."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        hashes = self._hashes[request_id]
        parent = hashes[-1] if hashes else chain_root(salt)
        for index in range(len(hashes), num_computed // self.block_size):
            start = index * self.block_size
            parent = block_hash(parent, token_ids[start : start + self.block_size])
            hashes.append(parent)
            self.pool.name(table[index], parent)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.block_tables[request_id]]

    def free(self, request_id: str) -> None:
        """Returns the request's blocks; a no-op for a request that holds none."""
        table = self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table:
            self.pool.release(list(reversed(table)))

    def cached_block_hashes(self) -> list[int]:
        return list(self.pool.cached)
