"""Automatic prefix caching across sessions: full KV pages keyed by a hash chain of their token ids.

A KV page is vLLM's "KV block" (its names are kept where its sources are cited); here "block" means only a
draft block. Follows vLLM v1 (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``, ``block_pool.py``
``BlockPool.cache_full_blocks`` / ``get_cached_block`` / the LRU free-block queue, ``kv_cache_manager.py``
``get_computed_blocks``), reduced to what one verifier replica needs:

- **Keys.** Page ``i`` of a sequence (token positions ``[i*B, (i+1)*B)``, ``B`` = page size) is keyed by
  ``hash(parent_hash, its B token ids, extra keys)``, the parent being page ``i-1``'s key, and page 0's parent
  the *root*: a hash of the model id and, when salting per tenant, the tenant id. Two pages share a key only
  when every token id up to and including them is the same (and the model, and the tenant where salted).
  SHA-256 over a fixed byte encoding: collisions are not a practical concern, and keys are stable across
  processes (unlike Python's ``hash``).
- **What gets cached.** Only FULL pages whose every position holds the KV of a COMMITTED token. A session's
  KV holds ``committed[:-1]`` (the last committed token is fed with the next draft block), so the full pages
  ready to cache are the first ``(committed_length - 1) // B`` (:func:`num_cacheable_pages`). Every later
  forward pass of that session writes at positions ``>= committed_length - 1``: never inside a cached page.
  A session's last, partial page is always its own, and positions a rejection rolls back are never in one.
- **Lookup.** A new prompt takes the longest chain of its leading page keys that is cached, capped so that at
  least the prompt's last token is prefilled (its KV is not needed, but vLLM recomputes the last prompt token
  too: here the prefill covers ``prompt[:-1]``, so the cap is ``(len(prompt) - 1) // B`` pages).
- **Reference counts and eviction.** The KV page pool (:mod:`cloud_verifier.kv.pool`) counts the sessions
  using each page. When a cached page's count drops to 0 the pool's release hook
  (:meth:`PrefixCache.on_release`) keeps it here as *evictable* instead of freeing it; a later session may take
  it again (:meth:`PrefixCache.take_prefix`); an allocation short of free pages evicts the least recently
  released ones and drops their keys (:meth:`PrefixCache.allocate`). A page in use (count > 0) is never evicted.

Tenant isolation: a page is shared only where token ids (and model) are identical, so no tenant ever reads
another's KV for different tokens. Sharing is still observable as time to open (a cached prefix opens faster):
docs/security.md, "Prefix caching", and ``SPECDEC_PREFIX_CACHE_SALT=tenant`` to confine sharing to a tenant.

Thread safety: see :class:`PrefixCache` (one lock; the pool's release hook takes none).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.common.errors import CapacityError

PageHash = bytes  # a SHA-256 digest, 32 bytes

SALT_MODES = ("none", "tenant")


def root_hash(model_id: str, salt: str = "") -> PageHash:
    """The parent key of every sequence's first page: the model id and the salt (a tenant id, or "").

    vLLM seeds its chain with ``NONE_HASH`` and puts a request's ``cache_salt`` in the first page's extra keys;
    folding both into the root is equivalent (each key still depends on them) and keeps per-page hashing uniform.
    """
    h = hashlib.sha256(b"specdec-prefix-cache-v1\0")
    for part in (model_id, salt):
        data = part.encode("utf-8")
        h.update(struct.pack("<Q", len(data)))  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        h.update(data)
    return h.digest()


def hash_page_tokens(parent: PageHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> PageHash:
    """Key of one page: SHA-256 of the parent key, the page's token ids (int64 little-endian) and extra keys.

    Source: vLLM v1 ``kv_cache_utils.hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids,
    extra_keys)``.
    """
    n = len(token_ids)
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<Q{n}q", n, *token_ids))
    h.update(extra_keys)
    return h.digest()


def full_page_hashes(token_ids: Sequence[int], page_size: int, root: PageHash,
                      known: Sequence[PageHash] = ()) -> list[PageHash]:
    """Keys of every full page of ``token_ids`` (``len(token_ids) // page_size`` of them), in order.

    ``known``: keys already computed for the first pages of the same sequence (a session extends its list as it
    commits tokens, so each page is hashed once); they are reused, not checked.

    Raises:
        ValueError: page_size < 1.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    hashes = list(known[: len(token_ids) // page_size])
    parent = hashes[-1] if hashes else root
    for begin in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        parent = hash_page_tokens(parent, token_ids[begin : begin + page_size])
        hashes.append(parent)
    return hashes


def num_cacheable_pages(committed_length: int, page_size: int) -> int:
    """Full pages of a session whose KV is final: its KV cache holds ``committed[:-1]``, so the first
    ``(committed_length - 1) // page_size`` pages (0 for an empty session)."""
    return max(0, committed_length - 1) // page_size


def max_prefix_pages(prompt_length: int, page_size: int) -> int:
    """Most cached pages a prompt of ``prompt_length`` tokens may take: its prefill covers ``prompt[:-1]``
    (the last token goes with the first draft block), so a cached prefix never covers the last token."""
    return num_cacheable_pages(prompt_length, page_size)


@dataclass
class PrefixCacheStats:
    """Counters since start, as vLLM's ``PrefixCacheStats``: ``queries`` prompt tokens looked up, ``hits`` of
    them found cached, tokens; ``evicted`` pages dropped from the cache."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 with no query)."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """The key → page map over one :class:`cloud_verifier.kv.pool.PagePool`, and its evictable cached pages
    (reference count 0) in LRU order. Installs itself as the pool's ``on_release`` hook.

    Args:
        pool: the page pool (``allocate``, ``incref``, ``refcount``, ``release_cached``, ``num_free``,
            ``on_release``).
        page_size: tokens per KV page (the pool's).
        model_id: the served model's id (in every key's root).
        salt: ``"none"``: pages shared by all tenants (vLLM's default); ``"tenant"``: the tenant id is in the
            root, so pages are shared only within a tenant.
        enabled: False: lookups find nothing and nothing is registered (prefix caching off).

    Locks: the pool calls :meth:`on_release` under its own lock, so that hook takes no lock (it queues the
    page); every other method takes the cache's lock and may call the pool under it (order: cache, then pool).
    A cached page's reference count rises only under the cache's lock (:meth:`take_prefix`), so a page seen
    at 0 references under it cannot be taken by anyone meanwhile: eviction never hands back a page in use.

    Raises:
        ValueError: page_size < 1 or an unknown salt mode.
    """

    def __init__(self, pool, page_size: int, model_id: str, salt: str = "none", enabled: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if salt not in SALT_MODES:
            raise ValueError(f"unknown prefix cache salt {salt!r}: use {' or '.join(SALT_MODES)}")
        self.pool = pool
        self.page_size = int(page_size)
        self.model_id = model_id
        self.salt = salt
        self.enabled = bool(enabled)
        self.stats = PrefixCacheStats()
        self._page_of: dict[PageHash, int] = {}  # key -> page id
        self._key_of: dict[int, PageHash] = {}  # page id -> key
        self._depth: dict[int, int] = {}  # page id -> its index in its chain (0 = a sequence's first page)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, 0 references; oldest release first
        self._released: deque[int] = deque()  # cached pages the pool released, not yet in _evictable
        self._lock = threading.Lock()
        # per session KV (weakly: gone with it): (root, keys of its first pages), so that the pages its verify
        # commits fill are hashed once each (cache_committed), not the whole sequence every step
        self._chains: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        pool.on_release = self.on_release

    # ---------------------------------------------------------------- keys
    def root(self, tenant_id: str = "") -> PageHash:
        """The root key of a tenant's sequences (the tenant matters only with ``salt="tenant"``)."""
        return root_hash(self.model_id, tenant_id if self.salt == "tenant" else "")

    def page_hashes(self, token_ids: Sequence[int], tenant_id: str = "",
                     known: Sequence[PageHash] = ()) -> list[PageHash]:
        """Keys of the full pages of ``token_ids`` for ``tenant_id`` (:func:`full_page_hashes`)."""
        return full_page_hashes(token_ids, self.page_size, self.root(tenant_id), known)

    # ---------------------------------------------------------------- lookup
    def take_prefix(self, hashes: Sequence[PageHash], max_pages: int) -> list[int]:
        """The page ids of the longest cached chain ``hashes[:n]``, ``n <= max_pages``, each with one more
        reference for the caller (who decrefs them with the rest of its pages when done).

        Counts ``max_pages * page_size`` queried and ``n * page_size`` hit tokens (vLLM counts the prompt;
        here the part that could have come from the cache). Source: vLLM v1 ``find_longest_cache_hit``.
        """
        max_pages = max(0, min(int(max_pages), len(hashes)))
        pages: list[int] = []
        with self._lock:
            self.stats.requests += 1
            self.stats.queries += max_pages * self.page_size
            if not self.enabled:
                metrics.PREFIX_CACHE_QUERIES.inc(max_pages * self.page_size)
                return pages
            self._drain()
            for key in hashes[:max_pages]:
                page = self._page_of.get(key)
                if page is None:
                    break
                pages.append(page)
            for page in pages:
                self._evictable.pop(page, None)
            self.pool.incref(pages)
            self.stats.hits += len(pages) * self.page_size
        metrics.PREFIX_CACHE_QUERIES.inc(max_pages * self.page_size)
        metrics.PREFIX_CACHE_HITS.inc(len(pages) * self.page_size)
        return pages

    def take_cached(self, token_ids: Sequence[int], tenant_id: str = "") -> list[int]:
        """For a session about to prefill ``token_ids[:-1]`` (its committed tokens): the pages of the longest
        cached prefix of them, at most :func:`max_prefix_pages` (each with one more reference for the session:
        its page table starts with them, and its prefill starts at ``len(result) * page_size``)."""
        n = max_prefix_pages(len(token_ids), self.page_size)
        return self.take_prefix(self.page_hashes(token_ids[: n * self.page_size], tenant_id), n)

    def cached_page(self, key: PageHash) -> int | None:
        """The page id cached under ``key``, or None (no side effect)."""
        with self._lock:
            return self._page_of.get(key)

    # ---------------------------------------------------------------- registering
    def register(self, page_id: int, key: PageHash, depth: int = 0) -> bool:
        """Cache ``page_id`` under ``key``: a FULL page of COMMITTED tokens (:func:`num_cacheable_pages`)
        that the caller holds and will not write again; ``depth``: its index in the sequence (page 0, 1, ...).

        Returns False, changing nothing, when caching is off, the page is already cached, or another page
        already holds ``key`` (two sessions prefilled the same prefix at once: the first stays, as in vLLM's
        ``cache_full_blocks``; the caller's copy is freed normally when released).

        Raises:
            ValueError: the caller holds no reference to ``page_id``.
        """
        with self._lock:
            if not self.enabled or page_id in self._key_of or key in self._page_of:
                return False
            if self.pool.refcount(page_id) < 1:
                raise ValueError(f"page {page_id} is not in use: only a held page can be cached")
            self._page_of[key] = page_id
            self._key_of[page_id] = key
            self._depth[page_id] = int(depth)
            return True

    def cache_full_pages(self, pages: Sequence[int], token_ids: Sequence[int], num_tokens: int,
                          tenant_id: str = "") -> int:
        """Register a session's full pages whose KV is final: ``pages`` is its page table, its KV holds
        ``token_ids[:num_tokens]`` and ``num_tokens`` must not exceed its committed length - 1 (so no later
        forward pass of the session writes there). Pages already cached are skipped. Returns how many were
        registered. Source: vLLM v1 ``BlockPool.cache_full_blocks``."""
        n = min(int(num_tokens) // self.page_size, len(pages), len(token_ids) // self.page_size)
        if not self.enabled or n <= 0:
            return 0
        keys = self.page_hashes(token_ids[: n * self.page_size], tenant_id)
        return sum(self.register(page, key, depth) for depth, (page, key) in enumerate(zip(pages[:n], keys)))

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._key_of

    # ---------------------------------------------------------------- the pool's side
    def on_release(self, page_id: int) -> bool:
        """The pool's hook (under the pool's lock) when ``page_id``'s reference count drops to 0. True: the
        page is cached and stays valid, evictable once queued (most recently released last); False: not cached,
        the pool frees it. Takes no lock: the page is queued, and moved to the LRU order under the cache's."""
        if page_id not in self._key_of:
            return False
        self._released.append(page_id)
        return True

    def _drain(self) -> None:
        """Released pages into the LRU order (under the cache's lock); one taken again since is skipped.

        Pages released together (a session freed) enter deepest first, so the tail of a sequence is evicted
        before its head: a chain's head is what every longer prompt needs (vLLM frees a request's pages in
        reverse order for the same reason)."""
        released = []
        while self._released:
            released.append(self._released.popleft())
        released.sort(key=lambda b: -self._depth.get(b, 0))  # stable: same depth keeps release order
        for page in released:
            if page in self._key_of and self.pool.refcount(page) == 0:
                self._evictable[page] = None
                self._evictable.move_to_end(page)

    def evict(self, num_pages: int) -> int:
        """Drop up to ``num_pages`` evictable pages, least recently released first, and give them back to the
        pool's free list; returns how many. Pages in use are never evicted."""
        out: list[int] = []
        with self._lock:
            self._drain()
            while self._evictable and len(out) < num_pages:
                page, _ = self._evictable.popitem(last=False)
                if self.pool.refcount(page) != 0:  # taken again: not evictable (cannot happen; kept safe)
                    continue
                del self._page_of[self._key_of.pop(page)]
                self._depth.pop(page, None)
                out.append(page)
            if out:
                self.pool.release_cached(out)
            self.stats.evicted += len(out)
        metrics.PREFIX_CACHE_EVICTIONS.inc(len(out))
        return len(out)

    def evict_all(self) -> int:
        """Every evictable page back to the pool (:meth:`evict`)."""
        return self.evict(self.pool.num_pages)

    def allocate(self, num_pages: int) -> list[int]:
        """``num_pages`` fresh pages from the pool, evicting least recently used cached pages when the free
        list is short (vLLM's free-block queue, where cached pages at 0 references are the last to be reused).

        Raises:
            common.errors.CapacityError: not enough free plus evictable pages (nothing is allocated).
        """
        short = num_pages - self.pool.num_free
        if short > 0:
            evictable = self.num_evictable
            if short > evictable:  # refused without evicting anything: the cache stays useful
                raise CapacityError(f"KV cache full: {num_pages} pages requested, {self.pool.num_free} free and "
                                    f"{evictable} cached of {self.pool.num_pages}")
            self.evict(short)
        return self.pool.allocate(num_pages)

    @property
    def num_evictable(self) -> int:
        """Cached pages no session uses (free for admission's accounting), pages."""
        with self._lock:
            self._drain()
            return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages with a key (in use or evictable), pages."""
        return len(self._key_of)


def attach_prefix_cache(target, model_id: str, enabled: bool = True, salt: str = "none") -> PrefixCache:
    """The prefix cache of ``target`` (a :class:`cloud_verifier.target.runner.TargetRunner`; one per KV pool), made on
    first use and set as ``target.prefix_cache`` (its allocations evict through it), else reconfigured: a runner
    shared by several verifiers (tests, benchmarks) keeps one cache. Turning it off gives back every evictable
    page at once.

    Raises:
        ValueError: an unknown salt mode.
    """
    if salt not in SALT_MODES:
        raise ValueError(f"unknown prefix cache salt {salt!r}: use {' or '.join(SALT_MODES)}")
    cache = getattr(target, "prefix_cache", None)
    if cache is None:
        cache = PrefixCache(target.kv_pool.pages, target.kv_page_size, model_id, salt, enabled)
        target.prefix_cache = cache
    else:
        cache.model_id, cache.salt, cache.enabled = model_id, salt, bool(enabled)
    if not cache.enabled:
        cache.evict_all()
    return cache


def open_session_kv(target, capacity: int, token_ids: Sequence[int], tenant_id: str = "",
                    use_cache: bool = True) -> tuple[object, int]:
    """A session's KV cache (:class:`cloud_verifier.kv.pool.SessionKV`, limit ``capacity`` tokens) about to
    prefill ``token_ids[:-1]``: its page table starts with the longest cached prefix (taken from
    ``target.prefix_cache``, when there is one and ``use_cache``), then fresh pages for the rest. Returns (kv, tokens cached):
    the prefill starts at that position.

    Raises:
        common.errors.CapacityError: a session of ``capacity`` tokens could not fit in the whole pool.
    """
    from specdec_runtime.cloud_verifier.kv.pool import SessionKV

    target.check_fits(capacity)
    cache = target.prefix_cache
    taken = cache.take_cached(token_ids, tenant_id) if cache is not None and use_cache else []
    kv = SessionKV(capacity, list(taken))
    try:
        # a pool short now is no error: the prefill chunks get their pages in the batcher (which waits for them,
        # or preempts sessions admitted after this one: cloud_verifier.kv.scheduler)
        target.try_ensure(kv, min(capacity, len(token_ids) - 1))
    except BaseException:
        target.free(kv)  # the cached pages taken go back too
        raise
    return kv, len(taken) * target.kv_page_size


def cache_prefilled(target, kv, token_ids: Sequence[int], num_tokens: int, tenant_id: str = "") -> int:
    """Register the full pages of ``kv`` holding ``token_ids[:num_tokens]`` in ``target.prefix_cache`` (none:
    nothing). ``num_tokens`` must not exceed the session's committed length - 1 (pages no later forward pass
    of the session writes): :meth:`PrefixCache.cache_full_pages`. Returns pages registered."""
    cache = target.prefix_cache
    if cache is None:
        return 0
    return cache.cache_full_pages(kv.pages, token_ids, min(int(num_tokens), len(token_ids)), tenant_id)


def cache_committed(target, kv, token_ids: Sequence[int], tenant_id: str = "") -> int:
    """After a verify commit: register the full pages of ``kv`` that the commit made final (every position below
    ``len(token_ids) - 1``, ``token_ids`` being the session's committed ids: :func:`num_cacheable_pages`) in
    ``target.prefix_cache``, so a session sending this conversation later takes them instead of prefilling.
    Incremental: each page is hashed once per session (its keys are kept with its KV), and a step that filled
    no page costs a comparison. Returns pages registered. Source: vLLM v1 ``cache_full_blocks`` after each
    scheduler step (``KVCacheManager.cache_blocks``)."""
    cache = target.prefix_cache
    if cache is None or not cache.enabled:
        return 0
    bs = cache.page_size
    n = min(num_cacheable_pages(len(token_ids), bs), len(kv.pages))
    root = cache.root(tenant_id)
    known_root, known = cache._chains.get(kv, (None, []))
    known = known if known_root == root else []
    if n <= len(known):
        return 0
    keys = full_page_hashes(token_ids[: n * bs], bs, root, known)
    cache._chains[kv] = (root, keys)
    return sum(cache.register(kv.pages[d], keys[d], d) for d in range(len(known), n))


def extend_session_kv(target, kv, token_ids: Sequence[int], start: int, tenant_id: str = "") -> tuple[int, int]:
    """An ExtendSession turn about to prefill ``token_ids[start:-1]`` (``start`` = the old committed length - 1;
    ``kv`` holds the positions before it): the pages after the one holding ``start`` are taken from the cache
    where it has them for these tokens (its page table gets them, fresh pages past them are dropped).

    Returns (begin, end): positions [begin, end) need no prefill (begin == end: nothing taken). They start at a
    page boundary past ``start``, so if the turn is not committed, rolling the table back to the old length
    drops every page taken and the next block of the session writes none of them.
    """
    cache = target.prefix_cache
    bs = target.kv_page_size
    first = -(-int(start) // bs)  # the first page holding no position before ``start``
    n = max_prefix_pages(len(token_ids), bs)
    if cache is None or n <= first or len(kv.pages) < first:
        return start, start
    taken = cache.take_prefix(cache.page_hashes(token_ids[: n * bs], tenant_id)[first:], n - first)
    if not taken:
        return start, start
    dropped = kv.pages[first:]
    kv.pages[first:] = taken
    if dropped:
        target.kv_pool.pages.decref(dropped)
    return first * bs, (first + len(taken)) * bs
