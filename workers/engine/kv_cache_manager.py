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


@dataclass
class NamingMark:
    """Where a request's named blocks stood at one moment (see KVCacheManager.mark_names)."""

    hashes: list[int]  # the request's list of names, which grows in place as blocks are named
    table: list[KVBlock]  # its block table, read even after the request's blocks were freed
    count: int

    def named_since(self) -> list[tuple[int, int, int]]:
        """(block index, name, block id) of the blocks named after the mark."""
        return [(i, self.hashes[i], self.table[i].block_id) for i in range(self.count, len(self.hashes))]


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
        self._reservations: dict[str, PrefixHit] = {}  # prefix blocks pinned for requests not admitted yet

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

    def fills_blocks(self, request_id: str, num_computed: int) -> bool:
        """Whether `num_computed` computed tokens fill a block of the request that has no name yet."""
        return self.enable_prefix_caching and num_computed // self.block_size > len(self._hashes[request_id])

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

    def mark_names(self, request_id: str) -> NamingMark | None:
        """A mark of the request's named blocks now (None when it holds no blocks): its `named_since` lists
        the blocks named after it, even once the request finished and its blocks were freed (their ids stay
        valid until the next step may overwrite them). The KV tier copies them out for its puts."""
        table = self.block_tables.get(request_id)
        hashes = self._hashes.get(request_id)
        if table is None or hashes is None:
            return None
        return NamingMark(hashes, table, len(hashes))

    def free(self, request_id: str) -> None:
        """Returns the request's blocks; a no-op for a request that holds none."""
        table = self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table:
            self.pool.release(list(reversed(table)))

    def cached_block_hashes(self) -> list[int]:
        return list(self.pool.cached)

    # ---- reservations: cached prefix blocks pinned for a request before it is admitted ---------------

    def reserve_prefix(self, request_id: str, token_ids: Sequence[int], salt: str = "") -> int:
        """Pins the longest cached prefix of `token_ids` named under `salt` (as `find_prefix` finds it,
        so at most (len(token_ids) - 1) // block_size blocks) for `request_id`: those blocks are not
        handed out again until the reservation becomes the request's block table (`allocate_reserved`)
        or is released. Returns its length in blocks."""
        if request_id in self._reservations or request_id in self.block_tables:
            raise ValueError(f"request {request_id} already holds KV blocks on this worker")
        hit = self.find_prefix(token_ids, salt)
        self.pool.share(hit.blocks)
        self._reservations[request_id] = hit
        return len(hit.blocks)

    def trim_reservation(self, request_id: str, num_blocks: int) -> None:
        """Keeps only the first `num_blocks` blocks of the request's reservation; releases the rest."""
        hit = self._reservations.get(request_id)
        if hit is None or num_blocks >= len(hit.blocks):
            return
        dropped = hit.blocks[num_blocks:]
        self._reservations[request_id] = PrefixHit(hit.blocks[:num_blocks], hit.hashes[:num_blocks])
        self.pool.release(list(reversed(dropped)))

    def allocate_reserved(self, request_id: str, num_tokens: int) -> bool:
        """Starts a new request's block table with its reserved blocks (none: an empty table) and fresh
        blocks for the rest of `num_tokens`. False, changing nothing, when there are not enough free
        blocks; the reservation then still holds."""
        hit = self._reservations.get(request_id)
        if not self.allocate(request_id, num_tokens, hit):
            return False
        self.release_reservation(request_id)  # the block table holds them now
        return True

    def release_reservation(self, request_id: str) -> None:
        """Gives back the request's reserved blocks; a no-op when it holds none."""
        hit = self._reservations.pop(request_id, None)
        if hit is not None:
            self.pool.release(list(reversed(hit.blocks)))

    def reserved_blocks(self, request_id: str) -> int:
        hit = self._reservations.get(request_id)
        return len(hit.blocks) if hit is not None else 0


def draft_blocks(num_blocks: int, block_size: int) -> KVCacheManager:
    """The block tables of a draft model's pool (spec_decode/draft_model.py): without a prefix cache, since
    a request's draft KV is kept only while it drafts step after step."""
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
