"""Automatic prefix caching (cloud_verifier/kv/prefix_cache.py): the hash chain, lookup, LRU eviction, salting.

Pure-Python tests of the cache on its own; the tests with the target and its KV pool follow below them."""

from __future__ import annotations

import sys
import threading

import pytest

from specdec_runtime.cloud_verifier.kv.pool import PagePool
from specdec_runtime.cloud_verifier.kv.prefix_cache import (
    PrefixCache,
    full_page_hashes,
    hash_page_tokens,
    max_prefix_pages,
    num_cacheable_pages,
    root_hash,
)
from specdec_runtime.common.errors import CapacityError

B = 4  # page size of the pure-Python tests, tokens


# ---------------------------------------------------------------- keys
def test_hash_chain_keys_depend_on_every_token_up_to_and_including_the_page():
    root = root_hash("model-a")
    base = list(range(100, 122))  # 5 full pages + 2 tokens
    keys = full_page_hashes(base, B, root)
    assert len(keys) == 5  # the partial last page has no key
    assert keys == full_page_hashes(base, B, root)  # deterministic
    for changed_at in (0, 5, 13, 19):
        other = list(base)
        other[changed_at] += 1
        other_keys = full_page_hashes(other, B, root)
        page = changed_at // B
        assert other_keys[:page] == keys[:page]  # pages before the change are shared
        assert all(a != b for a, b in zip(other_keys[page:], keys[page:]))  # it and every later one differ
    # a change in the partial tail changes no key
    assert full_page_hashes(base[:-1] + [7], B, root) == keys
    # the chain: a page's key is its parent's key hashed with its tokens
    assert keys[1] == hash_page_tokens(keys[0], base[4:8])
    assert keys[0] == hash_page_tokens(root, base[0:4])


def test_root_holds_model_and_salt_and_known_keys_are_reused():
    ids = list(range(12))
    assert full_page_hashes(ids, B, root_hash("a")) != full_page_hashes(ids, B, root_hash("b"))
    assert root_hash("ab", "c") != root_hash("a", "bc")  # length-prefixed parts
    root = root_hash("a")
    first = full_page_hashes(ids[:9], B, root)
    assert len(first) == 2
    assert full_page_hashes(ids, B, root, known=first) == full_page_hashes(ids, B, root)
    with pytest.raises(ValueError, match="page_size"):
        full_page_hashes(ids, 0, root)


def test_cacheable_pages_never_cover_the_last_committed_token():
    # the KV cache holds committed[:-1]: a page is final only once a committed token follows it
    assert [num_cacheable_pages(n, B) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    assert max_prefix_pages(500, 16) == 31 and max_prefix_pages(497, 16) == 31 and max_prefix_pages(496, 16) == 30


def _cache(num_pages: int = 16, **kwargs) -> PrefixCache:
    return PrefixCache(PagePool(num_pages), B, "m", **kwargs)


def _cached_sequence(cache: PrefixCache, token_ids: list[int], tenant: str = "") -> list[int]:
    """Pages holding ``token_ids``' full pages, registered (as a session's committed pages are): one ref each."""
    keys = cache.page_hashes(token_ids, tenant)
    pages = cache.allocate(len(keys))
    for page, key in zip(pages, keys):
        assert cache.register(page, key)
    return pages


def test_tenant_salt_isolates_and_no_salt_shares():
    ids = list(range(16))
    shared = _cache(salt="none")
    assert shared.page_hashes(ids, "t1") == shared.page_hashes(ids, "t2")
    salted = _cache(salt="tenant")
    k1, k2 = salted.page_hashes(ids, "t1"), salted.page_hashes(ids, "t2")
    assert all(a != b for a, b in zip(k1, k2))
    pages = _cached_sequence(salted, ids, "t1")
    assert salted.take_prefix(k2, 4) == []  # tenant 2 finds nothing of tenant 1's
    assert salted.take_prefix(salted.page_hashes(ids, "t1"), 4) == pages
    with pytest.raises(ValueError, match="salt"):
        _cache(salt="user")


# ---------------------------------------------------------------- lookup and reference counts
def test_take_prefix_finds_the_longest_cached_chain_within_the_cap_and_counts_tokens():
    cache = _cache()
    prompt = list(range(30))
    keys = cache.page_hashes(prompt)
    pages = _cached_sequence(cache, prompt[:12])  # 3 pages
    assert cache.take_prefix(keys, max_pages=7) == pages
    assert cache.take_prefix(keys, max_pages=2) == pages[:2]
    assert [cache.pool.refcount(b) for b in pages] == [3, 3, 2]  # the owner's reference + one per taker
    other = cache.page_hashes([99] + prompt[1:])  # differs in page 0: nothing, though later tokens match
    assert cache.take_prefix(other, 7) == []
    assert (cache.stats.requests, cache.stats.queries, cache.stats.hits) == (3, (7 + 2 + 7) * B, 5 * B)
    # a gap breaks the chain: page 1 missing, page 2 cached is not reachable
    gap = _cache()
    b0, b1, b2 = gap.allocate(3)
    gap.register(b0, keys[0])
    gap.register(b2, keys[2])
    assert gap.take_prefix(keys, 7) == [b0]


def test_register_keeps_the_first_page_for_a_key_and_never_rekeys_a_page():
    cache = _cache()
    keys = cache.page_hashes(list(range(8)))
    first, second = cache.allocate(2)
    assert cache.register(first, keys[0])
    assert not cache.register(second, keys[0])  # a second copy of the same prefix stays uncached
    assert not cache.register(first, keys[1])  # a cached page keeps its key
    cache.pool.decref([first, second])
    assert cache.pool.num_free == 15 and cache.pool.num_cached == 1  # the uncached copy is freed at once
    with pytest.raises(ValueError, match="not in use"):
        cache.register(second, keys[1])  # released: its KV may be reused any time


def test_eviction_is_lru_over_released_pages_and_spares_pages_in_use():
    cache = _cache(num_pages=5)
    keys = cache.page_hashes(list(range(5 * B)))
    pages = _cached_sequence(cache, list(range(5 * B)))
    assert cache.pool.num_free == 0
    # release order 3, 1, 4 (pages 0 and 2 stay in use)
    for i in (3, 1, 4):
        cache.pool.decref([pages[i]])
    assert cache.num_evictable == 3 and cache.pool.num_cached == 3 and cache.pool.num_free == 0
    assert cache.take_prefix(keys[:2], 2) == pages[:2]  # a session takes page 1 again: not evictable now
    assert cache.allocate(1) == [pages[3]]  # short of free pages: the least recently released goes
    cache.pool.decref([pages[1]])  # released again: now the most recent
    assert cache.evict(5) == 2 and cache.pool.num_free == 2  # pages 4 then 1; 0 and 2 (in use) never
    assert sorted(cache.allocate(2)) == sorted([pages[1], pages[4]])
    with pytest.raises(CapacityError):
        cache.allocate(1)  # nothing free, nothing evictable: pages in use stay
    cache.pool.decref([pages[0], pages[0]])  # its owner and the session that took it: evictable
    with pytest.raises(CapacityError, match="2 pages requested, 0 free and 1 cached"):
        cache.allocate(2)  # too few even with it: refused without evicting it
    assert cache.num_evictable == 1
    assert cache.take_prefix(keys, 5) == [pages[0]]  # page 1's key went with it: the chain stops there
    assert cache.stats.evicted == 3 and cache.num_cached == 2


def test_concurrent_release_take_and_evict_never_hand_back_a_page_in_use():
    # a page released by one session while another takes it and a third allocation evicts: the pool's checks
    # (release_cached of a referenced page, incref of a free one) raise if the cache ever gets it wrong
    cache = _cache(num_pages=8)
    ids = list(range(4 * B))
    keys = cache.page_hashes(ids)
    owner = _cached_sequence(cache, ids)
    errors: list[BaseException] = []

    def taker():
        try:
            for _ in range(300):  # a session: take the cached prefix, "prefill" and register the rest, close
                got = cache.take_prefix(keys, 4)
                try:
                    fresh = cache.allocate(len(keys) - len(got))
                except CapacityError:
                    fresh = []
                for page, key in zip(fresh, keys[len(got):]):
                    cache.register(page, key)
                cache.pool.decref(got + fresh)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def allocator():
        try:
            for _ in range(300):
                try:
                    cache.pool.decref(cache.allocate(5))
                except CapacityError:
                    pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    cache.pool.decref(owner)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the races need interleavings inside a few lines
    threads = [threading.Thread(target=f, daemon=True) for f in (taker, taker, allocator)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "deadlock: the pool's release hook and the cache's lock"
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    pool = cache.pool
    assert pool.num_used == 0 and pool.num_free + pool.num_cached == 8 and pool.num_cached == cache.num_evictable


def test_caching_off_finds_and_registers_nothing():
    cache = _cache(enabled=False)
    keys = cache.page_hashes(list(range(8)))
    assert not cache.register(cache.allocate(1)[0], keys[0])
    assert cache.take_prefix(keys, 2) == []
    assert cache.stats.queries == 2 * B and cache.stats.hits == 0


def test_a_session_caches_only_pages_before_its_last_committed_token_and_takes_them_back():
    cache = _cache()
    tokens = list(range(500, 523))  # 23 committed tokens: the KV holds 22 -> 5 full pages are final
    own = cache.allocate(6)
    assert cache.cache_full_pages(own, tokens, len(tokens) - 1) == 5
    assert cache.cache_full_pages(own, tokens, len(tokens) - 1) == 0  # already cached
    assert not cache.is_cached(own[5])  # the partial last page stays the session's own
    # a prompt of the same 21+ tokens takes the 5 pages; of 20 tokens only 4 (its last token is prefilled)
    assert cache.take_cached(tokens[:21]) == own[:5]
    assert cache.take_cached(tokens[:20]) == own[:4]
    assert cache.take_cached(tokens[:3] + [0] + tokens[4:]) == []
    assert cache.cache_full_pages(own, tokens, 3) == 0 and _cache(enabled=False).take_cached(tokens) == []


def test_a_freed_sequence_is_evicted_tail_first_so_its_head_stays_reusable():
    cache = _cache(num_pages=6)
    tokens = list(range(4 * B + 1))
    own = cache.allocate(4)
    assert cache.cache_full_pages(own, tokens, len(tokens) - 1) == 4
    cache.pool.decref(own)  # the session is freed: all four released at once, in table order
    assert cache.allocate(3) and cache.pool.num_free == 0  # 2 free + 1 evicted: the deepest page
    assert cache.take_cached(tokens) == own[:3]  # the head survives: a prompt with it still hits
