"""The draft's prefix cache on the device: KV snapshots of prompt prefixes, reused by NEW sessions that start
with the same tokens (an app's fixed system prompt, tool definitions), so such a prefix is prefilled once per
process instead of once per session.

A conversation keeps its draft KV between turns already (:class:`edge_client.drafting.drafter.ModelDrafter` keeps the
longest common prefix); this cache is for the next generation that starts afresh. :class:`DraftPrefixCache` is a
small LRU keyed by token-id prefix and bounded in bytes; ModelDrafter stores a snapshot when it has prefilled a
new context, and restores the longest cached prefix when a context starts beyond what it holds.

Only chunk-aligned prefixes are stored and restored: snapshots are cut at multiples of PREFILL_CHUNK_TOKENS, of KV
fed in whole chunks from position 0 (ModelDrafter's ``_canonical``), so a restored prefix holds exactly the KV a
prefill from scratch computes (an int8 draft's logits depend on the chunks a forward pass was fed in): a seeded
sampled generation gives the same tokens with the cache as without it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_DRAFT_PREFIX_CACHE_MB", "DraftPrefixCache"]

# the default bound of EdgeClient.connect and the CLI's clients: ~1,400 tokens of the SmolLM2-135M draft's
# float32 KV (45 KiB per token), a few system prompts
DEFAULT_DRAFT_PREFIX_CACHE_MB = 64.0


class DraftPrefixCache:
    """LRU of draft KV snapshots keyed by token-id prefix, at most ``max_mb`` MiB of arrays in all.

    Args:
        max_mb: the bound, MiB (a snapshot larger than it is not kept; 0 keeps nothing).
        align: prefixes are cut at multiples of it (tokens): ModelDrafter's PREFILL_CHUNK_TOKENS.

    Attributes:
        hits, misses: lookups that found a prefix of at least one chunk / found none.
        nbytes: bytes held now.

    Raises:
        ValueError: a negative bound or an align < 1.
    """

    def __init__(self, max_mb: float, align: int):
        if max_mb < 0 or align < 1:
            raise ValueError(f"prefix cache: max_mb must be >= 0 and align >= 1, got {max_mb}, {align}")
        self.max_bytes, self.align = int(max_mb * 2**20), int(align)
        self._entries: OrderedDict[tuple[int, ...], list[np.ndarray]] = OrderedDict()
        self.hits = self.misses = self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token_ids: Sequence[int], limit: int) -> tuple[int, list[np.ndarray]] | None:
        """The longest chunk-aligned prefix of ``token_ids``, at most ``limit`` tokens, that a snapshot holds:
        (its length m, the snapshot's arrays cut to m tokens: views, not copies), or None. Marks it used."""
        best, best_key = 0, None
        for key in self._entries:
            n = min(len(key), limit, len(token_ids))
            m = 0
            while m < n and key[m] == token_ids[m]:
                m += 1
            m -= m % self.align
            if m > best:
                best, best_key = m, key
        if best_key is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best_key)
        return best, [t[:, :, :best] for t in self._entries[best_key]]

    def covers(self, token_ids: Sequence[int]) -> bool:
        """Some snapshot already holds all of ``token_ids`` (storing them again would add nothing)."""
        n = len(token_ids)
        return any(len(key) >= n and list(key[:n]) == list(token_ids) for key in self._entries)

    def store(self, token_ids: Sequence[int], kv: list[np.ndarray]) -> None:
        """Keep ``kv`` (the snapshot of ``token_ids``, chunk-aligned) as the newest entry; drop the entries it
        extends (their prefixes are in it), then the least recently used ones until the bound holds."""
        key = tuple(int(t) for t in token_ids)
        size = sum(int(t.nbytes) for t in kv)
        if not key or len(key) % self.align or size > self.max_bytes or self.covers(key):
            return
        for old in [k for k in self._entries if key[: len(k)] == k]:
            self._drop(old)
        while self._entries and self.nbytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = kv
        self.nbytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= sum(int(t.nbytes) for t in self._entries.pop(key))
