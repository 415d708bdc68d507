"""Automatic prefix caching across sessions: full KV blocks keyed by a hash chain of their token ids.

Follows vLLM v1 (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``, ``block_pool.py``
``BlockPool.cache_full_blocks`` / ``get_cached_block`` / the LRU free-block queue, ``kv_cache_manager.py``
``get_computed_blocks``), reduced to what one verifier replica needs:

- **Keys.** Block ``i`` of a sequence (token positions ``[i*B, (i+1)*B)``, ``B`` = block size) is keyed by
  ``hash(parent_hash, its B token ids, extra keys)``, the parent being block ``i-1``'s key, and block 0's parent
  the *root*: a hash of the model id and, when salting per tenant, the tenant id. Two blocks share a key only
  when every token id up to and including them is the same (and the model, and the tenant where salted).
  SHA-256 over a fixed byte encoding: collisions are not a practical concern, and keys are stable across
  processes (unlike Python's ``hash``).
- **What gets cached.** Only FULL blocks whose every position holds the KV of a COMMITTED token. A session's
  KV holds ``committed[:-1]`` (the last committed token is fed with the next draft block), so the full blocks
  ready to cache are the first ``(committed_length - 1) // B`` (:func:`num_cacheable_blocks`). Every later
  forward pass of that session writes at positions ``>= committed_length - 1``: never inside a cached block.
  A session's last, partial block is always its own, and positions a rejection rolls back are never in one.
- **Lookup.** A new prompt takes the longest chain of its leading block keys that is cached, capped so that at
  least the prompt's last token is prefilled (its KV is not needed, but vLLM recomputes the last prompt token
  too: here the prefill covers ``prompt[:-1]``, so the cap is ``(len(prompt) - 1) // B`` blocks).
- **Reference counts and eviction.** The KV block pool (:mod:`cloud_verifier.kv_pool`) counts the sessions
  using each block. When a cached block's count drops to 0 the pool's release hook (:meth:`PrefixCache.on_release`)
  keeps it here as *evictable* (least recently released first) instead of freeing it; a later session may
  take it again (it leaves the evictable set); the pool, short of free blocks, asks :meth:`PrefixCache.evict`
  for the least recently used ones (their keys are dropped). A block in use (count > 0) is never evicted.

Tenant isolation: a block is shared only where token ids (and model) are identical, so no tenant ever reads
another's KV for different tokens. Sharing is still observable as time to open (a cached prefix opens faster):
docs/security.md, "Prefix caching", and ``SPECDEC_PREFIX_CACHE_SALT=tenant`` to confine sharing to a tenant.

Thread safety: every method takes the cache's own lock; it never calls out while holding it, so the pool may
call :meth:`on_release` / :meth:`evict` while holding its own lock (lock order: pool, then cache).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # a SHA-256 digest, 32 bytes

SALT_MODES = ("none", "tenant")


def root_hash(model_id: str, salt: str = "") -> BlockHash:
    """The parent key of every sequence's first block: the model id and the salt (a tenant id, or "").

    vLLM seeds its chain with ``NONE_HASH`` and puts a request's ``cache_salt`` in the first block's extra keys;
    folding both into the root is equivalent (each key still depends on them) and keeps per-block hashing uniform.
    """
    h = hashlib.sha256(b"specdec-prefix-cache-v1\0")
    for part in (model_id, salt):
        data = part.encode("utf-8")
        h.update(struct.pack("<Q", len(data)))  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        h.update(data)
    return h.digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """Key of one block: SHA-256 of the parent key, the block's token ids (int64 little-endian) and extra keys.

    Source: vLLM v1 ``kv_cache_utils.hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids,
    extra_keys)``.
    """
    n = len(token_ids)
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<Q{n}q", n, *token_ids))
    h.update(extra_keys)
    return h.digest()


def full_block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash,
                      known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Keys of every full block of ``token_ids`` (``len(token_ids) // block_size`` of them), in order.

    ``known``: keys already computed for the first blocks of the same sequence (a session extends its list as it
    commits tokens, so each block is hashed once); they are reused, not checked.

    Raises:
        ValueError: block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = list(known[: len(token_ids) // block_size])
    parent = hashes[-1] if hashes else root
    for begin in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes


def num_cacheable_blocks(committed_length: int, block_size: int) -> int:
    """Full blocks of a session whose KV is final: its KV cache holds ``committed[:-1]``, so the first
    ``(committed_length - 1) // block_size`` blocks (0 for an empty session)."""
    return max(0, committed_length - 1) // block_size


def max_prefix_blocks(prompt_length: int, block_size: int) -> int:
    """Most cached blocks a prompt of ``prompt_length`` tokens may take: its prefill covers ``prompt[:-1]``
    (the last token goes with the first draft block), so a cached prefix never covers the last token."""
    return num_cacheable_blocks(prompt_length, block_size)


@dataclass
class PrefixCacheStats:
    """Counters since start, as vLLM's ``PrefixCacheStats``: ``queries`` prompt tokens looked up, ``hits`` of
    them found cached, tokens; ``evicted`` blocks dropped from the cache."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 with no query)."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """The key → block map of one block pool, and its evictable (reference count 0) cached blocks in LRU order.

    Args:
        block_size: tokens per KV block (the pool's).
        model_id: the served model's id (in every key's root).
        salt: ``"none"``: blocks shared by all tenants (vLLM's default); ``"tenant"``: the tenant id is in the
            root, so blocks are shared only within a tenant.
        enabled: False: lookups find nothing and nothing is registered (prefix caching off).

    Raises:
        ValueError: block_size < 1 or an unknown salt mode.
    """

    def __init__(self, block_size: int, model_id: str, salt: str = "none", enabled: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if salt not in SALT_MODES:
            raise ValueError(f"unknown prefix cache salt {salt!r}: use {' or '.join(SALT_MODES)}")
        self.block_size = int(block_size)
        self.model_id = model_id
        self.salt = salt
        self.enabled = bool(enabled)
        self.stats = PrefixCacheStats()
        self._block_of: dict[BlockHash, int] = {}  # key -> block id
        self._key_of: dict[int, BlockHash] = {}  # block id -> key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, count 0; oldest release first
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- keys
    def root(self, tenant_id: str = "") -> BlockHash:
        """The root key of a tenant's sequences (the tenant matters only with ``salt="tenant"``)."""
        return root_hash(self.model_id, tenant_id if self.salt == "tenant" else "")

    def block_hashes(self, token_ids: Sequence[int], tenant_id: str = "",
                     known: Sequence[BlockHash] = ()) -> list[BlockHash]:
        """Keys of the full blocks of ``token_ids`` for ``tenant_id`` (:func:`full_block_hashes`)."""
        return full_block_hashes(token_ids, self.block_size, self.root(tenant_id), known)

    # ---------------------------------------------------------------- lookup
    def take_prefix(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """The block ids of the longest cached chain ``hashes[:n]``, ``n <= max_blocks``, taken out of the
        evictable set (so the pool cannot evict them before the caller increfs them: it must, at once).

        Counts ``max_blocks * block_size`` queried and ``n * block_size`` hit tokens (vLLM counts the prompt;
        here the part that could have been cached). Source: vLLM v1 ``find_longest_cache_hit``.
        """
        max_blocks = max(0, min(int(max_blocks), len(hashes)))
        blocks: list[int] = []
        with self._lock:
            self.stats.requests += 1
            self.stats.queries += max_blocks * self.block_size
            if not self.enabled:
                return blocks
            for key in hashes[:max_blocks]:
                block = self._block_of.get(key)
                if block is None:
                    break
                blocks.append(block)
            for block in blocks:
                self._evictable.pop(block, None)
            self.stats.hits += len(blocks) * self.block_size
        return blocks

    def cached_block(self, key: BlockHash) -> int | None:
        """The block id cached under ``key``, or None (no side effect)."""
        with self._lock:
            return self._block_of.get(key)

    # ---------------------------------------------------------------- registering
    def register(self, block_id: int, key: BlockHash) -> bool:
        """Cache ``block_id`` (a full block of committed tokens, in use by the caller) under ``key``.

        Returns False, changing nothing, when caching is off, the block is already cached, or another block
        already holds ``key`` (two sessions prefilled the same prefix at once: the first stays, as in vLLM's
        ``cache_full_blocks``; the caller's copy is freed normally when released).
        """
        with self._lock:
            if not self.enabled or block_id in self._key_of or key in self._block_of:
                return False
            self._block_of[key] = block_id
            self._key_of[block_id] = key
            return True

    def is_cached(self, block_id: int) -> bool:
        with self._lock:
            return block_id in self._key_of

    # ---------------------------------------------------------------- the pool's hooks
    def on_release(self, block_id: int) -> bool:
        """The pool's hook when ``block_id``'s reference count drops to 0. True: the block is cached and stays
        here, evictable (most recently released last), and the pool must not reuse it until :meth:`evict`
        hands it back; False: not cached, the pool frees it."""
        with self._lock:
            if block_id not in self._key_of:
                return False
            self._evictable[block_id] = None
            self._evictable.move_to_end(block_id)
            return True

    def evict(self, num_blocks: int) -> list[int]:
        """Drop up to ``num_blocks`` evictable blocks, least recently released first, and return their ids for
        the pool to reuse (fewer when fewer are evictable). Blocks in use are never evicted."""
        out: list[int] = []
        with self._lock:
            while self._evictable and len(out) < num_blocks:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                out.append(block)
            self.stats.evicted += len(out)
        return out

    def evict_all(self) -> list[int]:
        """Every evictable block (:meth:`evict`), e.g. to turn caching off at run time."""
        return self.evict(len(self._evictable))

    @property
    def num_evictable(self) -> int:
        """Cached blocks no session uses (free for the pool's accounting, reusable after eviction), blocks."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with a key (in use or evictable), blocks."""
        return len(self._key_of)
