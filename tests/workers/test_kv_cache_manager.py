"""Blocks: handed out, shared through the prefix cache, counted, evicted least recently used first,
and all free again at the end."""

import pytest

from diptych_common.prefix_hash import block_hashes
from workers.engine.kv_cache_manager import BlockPool, KVCacheManager

SIZE = 4


def tokens(count: int, start: int = 100) -> list[int]:
    return list(range(start, start + count))


def test_a_request_gets_enough_blocks_and_returns_them():
    kv = KVCacheManager(num_blocks=8, block_size=SIZE)
    assert kv.allocate("a", 9)
    assert len(kv.block_tables["a"]) == 3 and kv.num_free_blocks == 5
    assert kv.allocate("a", 12) and len(kv.block_tables["a"]) == 3
    assert kv.allocate("a", 13) and len(kv.block_tables["a"]) == 4
    kv.free("a")
    assert kv.num_free_blocks == 8 and not kv.block_tables


def test_allocation_fails_without_changing_anything_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=4, block_size=SIZE)
    assert kv.allocate("a", 12)
    assert not kv.allocate("b", 8)
    assert "b" not in kv.block_tables and kv.num_free_blocks == 1
    assert not kv.allocate("a", 20)
    assert len(kv.block_tables["a"]) == 3


def test_full_blocks_are_named_by_the_shared_hash_chain_and_found_again():
    kv = KVCacheManager(num_blocks=16, block_size=SIZE)
    prompt = tokens(10)
    kv.allocate("a", 10)
    kv.cache_full_blocks("a", prompt, 10)
    assert kv.cached_block_hashes() == block_hashes(prompt, SIZE)  # the gateway's names, exactly
    hit = kv.find_prefix([*tokens(8), 7, 7, 7])
    assert hit.num_tokens(SIZE) == 8 and hit.blocks == kv.block_tables["a"][:2]
    assert kv.find_prefix([1, *tokens(9)]).blocks == []  # a different first token shares nothing
    # A prompt that is exactly the cached blocks keeps its last token to compute.
    assert kv.find_prefix(tokens(8)).num_tokens(SIZE) == 4


def test_shared_blocks_are_counted_and_freed_only_by_their_last_user():
    kv = KVCacheManager(num_blocks=8, block_size=SIZE)
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", tokens(9), 9)
    hit = kv.find_prefix([*tokens(8), 1, 2])
    assert kv.allocate("b", 10, hit)
    shared = kv.block_tables["a"][:2]
    assert kv.block_tables["b"][:2] == shared and [b.ref_count for b in shared] == [2, 2]
    kv.free("a")
    assert [b.ref_count for b in shared] == [1, 1] and kv.num_free_blocks == 8 - 3
    kv.free("b")
    assert kv.num_free_blocks == 8 and all(b.ref_count == 0 for b in kv.pool.blocks)


def test_freed_named_blocks_serve_hits_until_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=4, block_size=SIZE)
    for name, start in (("old", 0), ("new", 500)):
        kv.allocate(name, 8)
        kv.cache_full_blocks(name, tokens(8, start), 8)
        kv.free(name)
    assert kv.num_free_blocks == 4 and len(kv.cached_block_hashes()) == 4
    version = kv.pool.version
    hit = kv.find_prefix([*tokens(8, 500), 1])
    assert kv.allocate("again", 9, hit)  # revives both cached blocks of "new", takes one more
    assert kv.num_free_blocks == 1
    # The block taken was the least recently freed: "old"'s tail (a request's tail goes first), so its
    # head still serves hits.
    assert kv.find_prefix([*tokens(8, 0), 1]).num_tokens(SIZE) == SIZE
    assert kv.pool.version > version
    kv.free("again")
    assert kv.num_free_blocks == 4


def test_a_revived_block_is_not_counted_as_free_twice():
    kv = KVCacheManager(num_blocks=3, block_size=SIZE)
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", tokens(8), 8)
    kv.free("a")
    hit = kv.find_prefix([*tokens(8), 1])
    # Two blocks are free only because they are the cached hit: 2 cached + 2 new > 3 blocks.
    assert not kv.allocate("b", 16, hit)
    assert all(b.ref_count == 0 for b in kv.pool.blocks) and kv.num_free_blocks == 3


def test_a_block_released_twice_is_a_bug_caught_loudly():
    pool = BlockPool(2)
    blocks = pool.take(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks)


def test_prefix_caching_can_be_turned_off():
    kv = KVCacheManager(num_blocks=8, block_size=SIZE, enable_prefix_caching=False)
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", tokens(8), 8)
    assert kv.cached_block_hashes() == [] and kv.find_prefix(tokens(9)).blocks == []


def test_cached_blocks_are_found_only_under_the_salt_that_named_them():
    kv = KVCacheManager(num_blocks=16, block_size=SIZE)
    prompt = tokens(12)
    kv.allocate("a", 12)
    kv.cache_full_blocks("a", prompt, 12, salt="org-a")
    assert kv.cached_block_hashes() == block_hashes(prompt, SIZE, "org-a")  # the gateway's salted names
    assert kv.find_prefix([*prompt, 1], salt="org-a").num_tokens(SIZE) == 12
    # Another organization's identical prompt, and an unsalted one, hit nothing.
    assert kv.find_prefix([*prompt, 1], salt="org-b").blocks == []
    assert kv.find_prefix([*prompt, 1]).blocks == []


def test_blocks_named_after_a_prefix_hit_continue_the_salted_chain():
    kv = KVCacheManager(num_blocks=16, block_size=SIZE)
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", tokens(8), 8, salt="org-a")
    longer = tokens(16)
    hit = kv.find_prefix([*longer, 1], salt="org-a")
    kv.allocate("b", 17, hit)
    kv.cache_full_blocks("b", longer, 16, salt="org-a")
    assert kv.find_prefix([*longer, 1], salt="org-a").num_tokens(SIZE) == 16
    assert kv.find_prefix([*longer, 1], salt="org-b").blocks == []


def test_salted_chains_differ_from_the_first_block_on_and_the_empty_salt_is_the_plain_chain():
    prompt = tokens(8)
    salted = [block_hashes(prompt, SIZE, salt) for salt in ("org-a", "org-b", "")]
    assert not set(salted[0]) & set(salted[1]) and not set(salted[0]) & set(salted[2])
    assert salted[2] == block_hashes(prompt, SIZE)
