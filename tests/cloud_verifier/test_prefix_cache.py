"""Automatic prefix caching (cloud_verifier/prefix_cache.py): the hash chain, lookup, LRU eviction, salting.

Pure-Python tests of the cache on its own; the tests with the target and its KV pool follow below them."""

from __future__ import annotations

import pytest

from cloud_verifier.prefix_cache import (
    PrefixCache,
    full_block_hashes,
    hash_block_tokens,
    max_prefix_blocks,
    num_cacheable_blocks,
    root_hash,
)

B = 4  # block size of the pure-Python tests, tokens


# ---------------------------------------------------------------- keys
def test_hash_chain_keys_depend_on_every_token_up_to_and_including_the_block():
    root = root_hash("model-a")
    base = list(range(100, 122))  # 5 full blocks + 2 tokens
    keys = full_block_hashes(base, B, root)
    assert len(keys) == 5  # the partial last block has no key
    assert keys == full_block_hashes(base, B, root)  # deterministic
    for changed_at in (0, 5, 13, 19):
        other = list(base)
        other[changed_at] += 1
        other_keys = full_block_hashes(other, B, root)
        block = changed_at // B
        assert other_keys[:block] == keys[:block]  # blocks before the change are shared
        assert all(a != b for a, b in zip(other_keys[block:], keys[block:]))  # it and every later one differ
    # a change in the partial tail changes no key
    assert full_block_hashes(base[:-1] + [7], B, root) == keys
    # the chain: a block's key is its parent's key hashed with its tokens
    assert keys[1] == hash_block_tokens(keys[0], base[4:8])
    assert keys[0] == hash_block_tokens(root, base[0:4])


def test_root_holds_model_and_salt_and_known_keys_are_reused():
    ids = list(range(12))
    assert full_block_hashes(ids, B, root_hash("a")) != full_block_hashes(ids, B, root_hash("b"))
    assert root_hash("ab", "c") != root_hash("a", "bc")  # length-prefixed parts
    root = root_hash("a")
    first = full_block_hashes(ids[:9], B, root)
    assert len(first) == 2
    assert full_block_hashes(ids, B, root, known=first) == full_block_hashes(ids, B, root)
    with pytest.raises(ValueError, match="block_size"):
        full_block_hashes(ids, 0, root)


def test_cacheable_blocks_never_cover_the_last_committed_token():
    # the KV cache holds committed[:-1]: a block is final only once a committed token follows it
    assert [num_cacheable_blocks(n, B) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    assert max_prefix_blocks(500, 16) == 31 and max_prefix_blocks(497, 16) == 31 and max_prefix_blocks(496, 16) == 30


def test_tenant_salt_isolates_and_no_salt_shares():
    ids = list(range(16))
    shared = PrefixCache(B, "m", salt="none")
    assert shared.block_hashes(ids, "t1") == shared.block_hashes(ids, "t2")
    salted = PrefixCache(B, "m", salt="tenant")
    k1, k2 = salted.block_hashes(ids, "t1"), salted.block_hashes(ids, "t2")
    assert all(a != b for a, b in zip(k1, k2))
    for block, key in enumerate(k1):
        salted.register(block, key)
    assert salted.take_prefix(k2, 4) == []  # tenant 2 finds nothing of tenant 1's
    assert salted.take_prefix(salted.block_hashes(ids, "t1"), 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="salt"):
        PrefixCache(B, "m", salt="user")


# ---------------------------------------------------------------- lookup and reference counts
def test_take_prefix_finds_the_longest_cached_chain_within_the_cap_and_counts_tokens():
    cache = PrefixCache(B, "m")
    prompt = list(range(30))
    keys = cache.block_hashes(prompt)
    for block, key in zip((10, 11, 12), keys[:3]):
        assert cache.register(block, key)
    assert cache.take_prefix(keys, max_blocks=7) == [10, 11, 12]
    assert cache.take_prefix(keys, max_blocks=2) == [10, 11]
    other = cache.block_hashes([99] + prompt[1:])  # differs in block 0: nothing, though later tokens match
    assert cache.take_prefix(other, 7) == []
    assert (cache.stats.requests, cache.stats.queries, cache.stats.hits) == (3, (7 + 2 + 7) * B, 5 * B)
    # a gap breaks the chain: block 1 missing, block 2 cached is not reachable
    gap = PrefixCache(B, "m")
    gap.register(0, keys[0])
    gap.register(2, keys[2])
    assert gap.take_prefix(keys, 7) == [0]


def test_register_keeps_the_first_block_for_a_key_and_never_rekeys_a_block():
    cache = PrefixCache(B, "m")
    keys = cache.block_hashes(list(range(8)))
    assert cache.register(1, keys[0])
    assert not cache.register(2, keys[0])  # a second copy of the same prefix stays uncached
    assert not cache.register(1, keys[1])  # a cached block keeps its key
    assert not cache.on_release(2)  # uncached: the pool frees it
    assert cache.num_cached == 1


def test_eviction_is_lru_over_released_blocks_and_spares_blocks_in_use():
    cache = PrefixCache(B, "m")
    keys = cache.block_hashes(list(range(5 * B)))
    for block, key in enumerate(keys):
        cache.register(block, key)
    # release order 3, 1, 4 (blocks 0 and 2 stay in use)
    assert all(cache.on_release(b) for b in (3, 1, 4))
    assert cache.num_evictable == 3
    # a session takes block 1 again (refcount back above 0): not evictable any more
    assert cache.take_prefix([keys[1]], 1) == [1]
    assert cache.evict(1) == [3]
    cache.on_release(1)  # released again: now the most recent
    assert cache.evict(5) == [4, 1]  # least recently released first; 0 and 2 (in use) never
    assert cache.evict(5) == []
    assert cache.take_prefix(keys, 5) == [0]  # block 1's key went with it: the chain stops there
    assert cache.stats.evicted == 3 and cache.num_cached == 2


def test_caching_off_finds_and_registers_nothing():
    cache = PrefixCache(B, "m", enabled=False)
    keys = cache.block_hashes(list(range(8)))
    assert not cache.register(0, keys[0])
    assert cache.take_prefix(keys, 2) == []
    assert cache.stats.queries == 2 * B and cache.stats.hits == 0
