"""Acceptance per draft version: what each delivered draft version achieves against this target.

A session that says which draft it drafts with (OpenSessionRequest ``draft_name``/``draft_version``) gets a
:class:`DraftTally`; every verdict of it counts there (the batcher calls ``metrics.observe_verdict`` with it):

- **Prometheus** (this replica): ``specdec_draft_num_drafts_total``, ``specdec_draft_num_draft_tokens_total``,
  ``specdec_draft_num_accepted_tokens_total``, labelled ``draft_version`` (``name@version``): the acceptance rate
  of a version is ``rate(num_accepted_tokens) / rate(num_draft_tokens)``, its mean accepted length
  ``1 + num_accepted_tokens / num_drafts`` (vLLM's spec-decode counters, per version).
- **The shared record** (every replica): a small hash per version in the session store's Redis,
  ``<prefix>draft:{<name@version>}:acceptance`` (one hash tag: one Cluster slot), with the three totals and a
  **baseline**: the totals at the moment the version passed ``baseline_blocks`` verify steps, frozen from then
  on (the first replica to pass it writes it, atomically: a Lua script). Replicas add their counts in batches
  (at most once per ``flush_interval_s``, from a worker thread: the batch loop never waits on Redis); a replica
  that dies loses at most its last unflushed interval. With the in-process store the record is this process's.

The label is in the session's store record (``SessionRecord.draft_label``): a session resumed on another replica
after a failover counts under the same version there. The watchdog's windows, per version and tenant, are kept
beside the record (:mod:`cloud_verifier.drafts.window`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from prometheus_client import Counter

from specdec_runtime.cloud_verifier.drafts.window import AcceptanceWindows

log = logging.getLogger(__name__)

DRAFT_NUM_DRAFTS = Counter("specdec_draft_num_drafts", "Verify steps, by draft version", ["draft_version"])
DRAFT_NUM_DRAFT_TOKENS = Counter("specdec_draft_num_draft_tokens", "Draft tokens verified, by draft version",
                                 ["draft_version"])
DRAFT_NUM_ACCEPTED_TOKENS = Counter("specdec_draft_num_accepted_tokens", "Draft tokens accepted, by draft version",
                                    ["draft_version"])
RECORD_TTL_S = 30 * 24 * 3600  # a version's shared record lives this long after its last block, s

# KEYS[1] the version's hash; ARGV: drafts, draft tokens, accepted tokens to add, baseline blocks, ttl s
_ADD_LUA = """
local d = redis.call('HINCRBY', KEYS[1], 'num_drafts', ARGV[1])
local t = redis.call('HINCRBY', KEYS[1], 'num_draft_tokens', ARGV[2])
local a = redis.call('HINCRBY', KEYS[1], 'num_accepted_tokens', ARGV[3])
if d >= tonumber(ARGV[4]) and redis.call('HEXISTS', KEYS[1], 'baseline_num_drafts') == 0 then
  redis.call('HSET', KEYS[1], 'baseline_num_drafts', d, 'baseline_num_draft_tokens', t,
             'baseline_num_accepted_tokens', a)
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
return d
"""
_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(frozen=True)
class DraftAcceptance:
    """A version's totals over every replica, and its baseline (None until ``baseline_blocks`` verify steps)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    baseline: tuple[int, int, int] | None = None  # (num_drafts, num_draft_tokens, num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        """num_accepted_tokens / num_draft_tokens (None before any draft token)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def baseline_acceptance_rate(self) -> float | None:
        """The baseline's acceptance rate (None before the baseline is set)."""
        if self.baseline is None or not self.baseline[1]:
            return None
        return self.baseline[2] / self.baseline[1]


class DraftTally:
    """One session's counters (``observe`` is called once per verdict by the batcher), added to its draft
    version's when it named one (``label``; None = unlabelled), in ``tenant``'s window; its log line reads them
    (:mod:`cloud_verifier.session.request_log`). Times are unix s."""

    def __init__(self, ledger: "AcceptanceLedger", label: str | None, tenant: str = ""):
        self.ledger = ledger
        self.label = label
        self.tenant = tenant
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_decode_steps = 0  # steps without draft tokens (cloud decode, target-only)
        self.num_committed = 0  # tokens committed (accepted + recovered/bonus)
        self.first_commit_at: float | None = None
        self.last_commit_at: float | None = None
        self.first_committed = 0  # tokens the first committing step committed

    def observe(self, num_draft_tokens: int, num_accepted: int, num_committed: int = 0) -> None:
        """One verdict: ``num_draft_tokens`` speculative tokens judged, ``num_accepted`` of them accepted,
        ``num_committed`` tokens committed."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_decode_steps += num_draft_tokens == 0
        if num_committed:
            now = time.time()
            if self.first_commit_at is None:
                self.first_commit_at, self.first_committed = now, num_committed
            self.last_commit_at = now
            self.num_committed += num_committed
        if self.label is not None:
            self.ledger.add(self.label, 1, num_draft_tokens, num_accepted, self.tenant)


class AcceptanceLedger:
    """Per-version acceptance of one replica, shared through ``store`` (see the module docstring).

    Args:
        store: the session store; a Redis one (``RedisSessionStore``) shares the record, any other keeps it here.
        baseline_blocks: verify steps after which a version's baseline is frozen, blocks.
        flush_interval_s: how often counts go to the shared record, at most, s.
        window_blocks: the watchdog's window, verify steps per version and tenant (:attr:`windows`).
    """

    def __init__(self, store=None, *, baseline_blocks: int = 200, flush_interval_s: float = 1.0,
                 window_blocks: int = 200):
        self.baseline_blocks = baseline_blocks
        self.flush_interval_s = flush_interval_s
        self.redis = _redis_of(store)  # the session store's Redis (None: the record is this process's)
        self.prefix = getattr(store, "prefix", "")  # its key prefix
        self.windows = AcceptanceWindows(self.redis, self.prefix, window_blocks)  # shared with the record
        self._script = self.redis.register_script(_ADD_LUA) if self.redis is not None else None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # held for a whole flush: the swap and the write
        self._pending: dict[str, list[int]] = {}
        self._local: dict[str, DraftAcceptance] = {}  # the record when there is no Redis
        self._next_flush = 0.0
        self._flushing = False

    @property
    def window_blocks(self) -> int:
        """Verify steps in each of the watchdog's windows."""
        return self.windows.window_blocks

    @window_blocks.setter
    def window_blocks(self, value: int) -> None:
        self.windows.window_blocks = int(value)

    def tally(self, name: str = "", version: str = "", tenant: str = "") -> DraftTally:
        """A new session's tally, counted under draft ``name`` at ``version`` ("" = unlabelled: the session's
        own counts only) and in ``tenant``'s window."""
        return DraftTally(self, f"{name}@{version}" if name and version else None, tenant)

    def tally_of(self, record) -> DraftTally:
        """The tally of a session from its store record (``draft_label`` "name@version", ``tenant_id``): a
        session opened or resumed here."""
        name, _, version = (record.draft_label or "").partition("@")
        return self.tally(name, version, record.tenant_id)

    def key(self, label: str) -> str:
        """The shared record's Redis key of ``label`` (``name@version``)."""
        return f"{self.prefix}draft:{{{label}}}:acceptance"

    def add(self, label: str, num_drafts: int, num_draft_tokens: int, num_accepted: int, tenant: str = "") -> None:
        """Count verify steps of ``label`` (``tenant``'s): Prometheus now, the shared record and window at the next
        flush."""
        DRAFT_NUM_DRAFTS.labels(label).inc(num_drafts)
        DRAFT_NUM_DRAFT_TOKENS.labels(label).inc(num_draft_tokens)
        DRAFT_NUM_ACCEPTED_TOKENS.labels(label).inc(num_accepted)
        if num_drafts == 1:
            self.windows.add(label, tenant, num_draft_tokens, num_accepted)
        with self._lock:
            pending = self._pending.setdefault(label, [0, 0, 0])
            pending[0] += num_drafts
            pending[1] += num_draft_tokens
            pending[2] += num_accepted
            due = not self._flushing and time.monotonic() >= self._next_flush
            if due:
                self._flushing = True
        if due:
            threading.Thread(target=self.flush, name="specdec-draft-ledger", daemon=True).start()

    def flush(self) -> None:
        """Add the pending counts to the shared record now (a failed write keeps them for the next flush). One
        flush at a time: a call waits for a background flush in flight, so its counts are in the record when
        the call returns."""
        with self._flush_lock:
            self._flush_pending()
            self.windows.flush()

    def _flush_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flushing = True
        try:
            for label, counts in pending.items():
                self._write(label, counts)
        except Exception as e:  # noqa: BLE001 - the record is statistics: a Redis outage must not fail a block
            log.warning("draft acceptance not recorded in the store (kept for the next try): %s", e)
            with self._lock:
                for label, counts in pending.items():
                    again = self._pending.setdefault(label, [0, 0, 0])
                    for i in range(3):
                        again[i] += counts[i]
        finally:
            with self._lock:
                self._flushing = False
                self._next_flush = time.monotonic() + self.flush_interval_s

    def _write(self, label: str, counts: list[int]) -> None:
        if self._script is not None:
            self._script(keys=[self.key(label)], args=[*counts, self.baseline_blocks, RECORD_TTL_S])
            return
        old = self._local.get(label, DraftAcceptance())
        d, t, a = old.num_drafts + counts[0], old.num_draft_tokens + counts[1], old.num_accepted_tokens + counts[2]
        baseline = old.baseline if old.baseline is not None or d < self.baseline_blocks else (d, t, a)
        self._local[label] = DraftAcceptance(d, t, a, baseline)

    def record(self, label: str) -> DraftAcceptance:
        """``label``'s shared record (every replica's flushed counts and the baseline)."""
        if self.redis is None:
            return self._local.get(label, DraftAcceptance())
        raw = {k.decode(): int(v) for k, v in self.redis.hgetall(self.key(label)).items()}
        baseline = tuple(raw[f"baseline_{f}"] for f in _FIELDS) if "baseline_num_drafts" in raw else None
        return DraftAcceptance(*(raw.get(f, 0) for f in _FIELDS), baseline=baseline)


def _redis_of(store):
    """The Redis client of a Redis session store, else None."""
    from specdec_runtime.cloud_verifier.store.redis import RedisSessionStore

    return store.client if isinstance(store, RedisSessionStore) else None
