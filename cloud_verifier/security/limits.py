"""Per-tenant limits of one verifier replica: concurrent sessions and verified tokens per second.

- **Sessions**: a tenant holds at most ``max_sessions`` sessions on this replica (sessions being opened
  included). Past it OpenSession is refused with RESOURCE_EXHAUSTED (:class:`~common.errors.RateLimitedError`,
  retry hint :data:`SESSION_RETRY_AFTER_MS`). Sessions resumed here from the store are counted but never refused
  (refusing a resume would strand a session that was admitted elsewhere).
- **Rate**: every verify block costs ``len(draft tokens) + 1`` tokens (the rows the target computes for it),
  taken from the tenant's token bucket (``tokens_per_s`` refill, ``burst_tokens`` capacity). A block that does
  not fit is refused before it is queued, with RESOURCE_EXHAUSTED and the time until it would fit
  (``retry-after-ms`` trailing metadata and the message); nothing is committed. Prompt prefill is not charged
  (a prompt is bounded by the context and the session cap).

The replica-wide limits (``max_sessions``, the KV-cache budget) stay as they are. These limits are per replica:
behind a balancer with R replicas a tenant can hold up to R × ``max_sessions`` sessions in all.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import Counter

from specdec_runtime.common.errors import RateLimitedError

SESSION_RETRY_AFTER_MS = 1000  # retry hint of a refused OpenSession (sessions end at unknown times), ms

TENANT_LIMITED = Counter("specdec_tenant_limited", "Calls refused by a per-tenant limit", ["limit"])


class TokenBucket:
    """A token bucket: ``rate`` tokens/s refill up to ``burst`` tokens; starts full. Not thread-safe."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated = now

    def take(self, cost: float, now: float) -> float:
        """Take ``cost`` tokens at time ``now`` (s) if there are enough: returns 0.0; else takes nothing and
        returns the wait until there would be, s. A cost above the burst is charged as the whole burst."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now
        cost = min(float(cost), self.burst)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate


class TenantLimits:
    """Per-tenant caps of one replica (see the module docstring).

    Args:
        max_sessions: sessions one tenant may hold on this replica; None = no cap.
        tokens_per_s: verified tokens per second per tenant (bucket refill), tokens/s; None = no rate limit.
        burst_tokens: bucket capacity, tokens; None = max(2 × tokens_per_s, ``min_burst``).
        min_burst: the smallest burst allowed: the cost of the largest block (γ_max + 1), tokens.
        clock: monotonic clock, s (tests).

    Raises:
        ValueError: a limit <= 0, or a burst below ``min_burst`` (such a block could never pass).
    """

    def __init__(self, max_sessions: int | None = None, tokens_per_s: float | None = None,
                 burst_tokens: float | None = None, *, min_burst: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"tenant max sessions must be >= 1, got {max_sessions}")
        if tokens_per_s is not None and not (tokens_per_s > 0 and math.isfinite(tokens_per_s)):
            raise ValueError(f"tenant tokens per second must be > 0, got {tokens_per_s}")
        if tokens_per_s is not None:
            burst_tokens = max(2.0 * tokens_per_s, min_burst) if burst_tokens is None else burst_tokens
            if burst_tokens < min_burst:
                raise ValueError(f"tenant token burst {burst_tokens:g} is below the cost of the largest block "
                                 f"({min_burst:g} tokens): such blocks could never pass")
        self.max_sessions = max_sessions
        self.tokens_per_s = tokens_per_s
        self.burst_tokens = burst_tokens
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._opening: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Some limit is set."""
        return self.max_sessions is not None or self.tokens_per_s is not None

    def charge(self, tenant: str, tokens: int) -> None:
        """Take ``tokens`` (a block's draft tokens + 1) from ``tenant``'s bucket.

        Raises:
            RateLimitedError: not enough tokens now (RESOURCE_EXHAUSTED; ``retry_after_ms`` = the wait, ms).
        """
        if self.tokens_per_s is None:
            return
        with self._lock:
            now = self.clock()
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = self._buckets[tenant] = TokenBucket(self.tokens_per_s, self.burst_tokens, now)
            wait_s = bucket.take(tokens, now)
        if wait_s > 0:
            TENANT_LIMITED.labels(limit="rate").inc()
            retry_ms = max(1, math.ceil(wait_s * 1000))
            raise RateLimitedError(
                f"tenant {tenant!r} is over its verify rate of {self.tokens_per_s:g} tokens/s "
                f"(burst {self.burst_tokens:g}): retry in {retry_ms} ms", retry_ms)

    @contextlib.contextmanager
    def opening(self, tenant: str, held: int) -> Iterator[None]:
        """Admit one more session of ``tenant`` for the ``with`` body (its prefill), given ``held`` sessions of
        the tenant already on the replica; sessions being opened count too.

        Raises:
            RateLimitedError: the tenant is at its session cap (RESOURCE_EXHAUSTED, retry hint
                :data:`SESSION_RETRY_AFTER_MS`).
        """
        if self.max_sessions is None:
            yield
            return
        with self._lock:
            in_progress = self._opening.get(tenant, 0)
            if held + in_progress >= self.max_sessions:
                TENANT_LIMITED.labels(limit="sessions").inc()
                raise RateLimitedError(
                    f"tenant {tenant!r} holds {held + in_progress} of its {self.max_sessions} sessions on this "
                    f"verifier: close one, or retry in {SESSION_RETRY_AFTER_MS} ms", SESSION_RETRY_AFTER_MS)
            self._opening[tenant] = in_progress + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._opening[tenant] - 1
                if left:
                    self._opening[tenant] = left
                else:
                    del self._opening[tenant]
