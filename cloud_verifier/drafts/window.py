"""The acceptance windows the watchdog reads (:mod:`cloud_verifier.drafts.watchdog`): per draft version and per
tenant, the last ``window_blocks`` verify steps that carried draft tokens, over every replica.

A version can fit one tenant's traffic and not another's (code against chat, one language against another), so a
window is kept per ``(version, tenant)``; tenant "" is the traffic of no API key. With a Redis session store the
windows are shared by every replica: each replica appends its steps in batches (with the ledger's flush, at most
once per ``flush_interval_s``) to one Redis list per window, trimmed to ``window_blocks`` in the same Lua script,
so every replica reads the same window and takes the same decision. Keys (one hash tag per version: one Cluster
slot with its acceptance record)::

    <prefix>draft:{<name@version>}:window:<tenant>    list of "draft_tokens,accepted" per verify step
    <prefix>draft:{<name@version>}:tenants            set of the tenants that have a window

With any other store the windows are this process's. Steps without draft tokens (cloud decode on a labelled
session) measure nothing and are left out. A window is statistics: a batch that cannot be written (Redis down) is
dropped with one log line, never retried into a block's path.
"""

from __future__ import annotations

import collections
import logging
import threading

log = logging.getLogger(__name__)

WINDOW_TTL_S = 30 * 24 * 3600  # a window lives this long after its last step, s

# KEYS[1] the window list, KEYS[2] the version's tenant set; ARGV: window blocks, ttl s, tenant, entries...
_PUSH_LUA = """
redis.call('RPUSH', KEYS[1], unpack(ARGV, 4))
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return redis.call('LLEN', KEYS[1])
"""


class AcceptanceWindows:
    """The windows of one replica, shared through ``redis`` (None: kept here). ``prefix``: the store's key
    prefix; ``window_blocks``: verify steps per window."""

    def __init__(self, redis=None, prefix: str = "", window_blocks: int = 200):
        self.window_blocks = window_blocks
        self._redis = redis
        self._prefix = prefix
        self._script = redis.register_script(_PUSH_LUA) if redis is not None else None
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], list[tuple[int, int]]] = {}
        self._local: dict[tuple[str, str], collections.deque] = {}

    def key(self, label: str, tenant: str) -> str:
        """The Redis list of ``label``'s (``name@version``) window for ``tenant``."""
        return f"{self._prefix}draft:{{{label}}}:window:{tenant}"

    def _tenants_key(self, label: str) -> str:
        return f"{self._prefix}draft:{{{label}}}:tenants"

    def add(self, label: str, tenant: str, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify step of ``label`` for ``tenant`` (shared at the next :meth:`flush`; kept here at once
        without Redis). Steps without draft tokens are ignored."""
        if num_draft_tokens <= 0:
            return
        with self._lock:
            if self._redis is None:
                self._window(label, tenant).append((num_draft_tokens, num_accepted))
            else:
                self._pending.setdefault((label, tenant), []).append((num_draft_tokens, num_accepted))

    def _window(self, label: str, tenant: str) -> collections.deque:
        """This process's window (caller holds the lock)."""
        window = self._local.get((label, tenant))
        if window is None or window.maxlen != self.window_blocks:
            window = self._local[(label, tenant)] = collections.deque(window or (), maxlen=self.window_blocks)
        return window

    def flush(self) -> None:
        """Append the pending steps to the shared windows now (no-op without Redis)."""
        if self._script is None:
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        for (label, tenant), steps in pending.items():
            entries = [f"{d},{a}" for d, a in steps[-self.window_blocks:]]
            try:
                self._script(keys=[self.key(label, tenant), self._tenants_key(label)],
                             args=[self.window_blocks, WINDOW_TTL_S, tenant, *entries])
            except Exception as e:  # noqa: BLE001 - statistics: a Redis outage must not fail a block
                log.warning("draft acceptance window of %s (tenant %r) not recorded: %s", label, tenant, e)

    def window(self, label: str, tenant: str) -> tuple[int, int, int]:
        """(verify steps, draft tokens, accepted tokens) of ``label``'s window for ``tenant``: its last
        ``window_blocks`` steps with draft tokens, every replica's (flushed) ones with Redis."""
        if self._redis is None:
            with self._lock:
                steps = list(self._local.get((label, tenant), ()))
        else:
            raw = self._redis.lrange(self.key(label, tenant), -self.window_blocks, -1)
            steps = [tuple(int(x) for x in entry.split(b",")) for entry in raw]
        return len(steps), sum(d for d, _ in steps), sum(a for _, a in steps)

    def tenants(self, label: str) -> set[str]:
        """The tenants that have a window of ``label``."""
        if self._redis is None:
            with self._lock:
                return {t for (lab, t) in self._local if lab == label}
        return {t.decode() for t in self._redis.smembers(self._tenants_key(label))}

    def reset(self, label: str, tenant: str) -> None:
        """Forget ``label``'s window for ``tenant`` (a version quarantined or cleared starts a fresh one)."""
        with self._lock:
            self._local.pop((label, tenant), None)
            self._pending.pop((label, tenant), None)
        if self._redis is not None:
            self._redis.delete(self.key(label, tenant))
