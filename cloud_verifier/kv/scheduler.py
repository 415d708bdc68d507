"""KV pages for one forward pass, with recompute preemption when the paged pool is short.

Admission counts the KV pages sessions actually hold (:mod:`cloud_verifier.session.admission`), so the sessions of one
replica may together need more pages than the pool has. Before each forward pass the batcher asks
:meth:`KVScheduler.plan` for the pages of every row, in priority order (earliest admitted first, vLLM v1's FCFS
scheduler order). When the pool (free plus evictable cached pages) is short for a row, the lowest-priority
session holding pages (the most recently admitted one, not already given pages for this pass, ranked after the
row's own) is preempted: its whole page table is dropped (:meth:`cloud_verifier.target.runner.TargetRunner.preempt`;
its committed full pages stay in the prefix cache as evictable), its queued work, if any, waits. A row that
still finds no pages (every session ranked after it holds none) is deferred: it goes back to the batcher, which
offers it again at the next step; its client only waits.

A preempted session's next row (a verify block, a cloud-decode step, a prefill chunk) first takes the longest
cached prefix of its tokens back, then recomputes the rest of its KV from its committed token ids in the same
forward pass (one row: the recomputed positions, then the row's own tokens; logits only for the row's own).
A hybrid target's session (:mod:`cloud_verifier.kv.recurrent_state`) whose recurrent state does not reach its
row (preempted, a failed forward pass, an ExtendSession turn rolled back) recomputes from position 0 the same way.
This is vLLM v1's recompute preemption (``vllm/v1/core/sched/scheduler.py``: ``_preempt_request`` frees the
pages, a resumed request is prefilled again and hits the prefix cache for its computed pages). Nothing
committed is lost and no token changes: the KV of committed tokens is a function of the token ids.

Bounded: a session is preempted only for a session admitted before it, so the earliest admitted session with
work is never preempted and always gets its pages (any session fits the whole pool alone: refused at open
otherwise); it finishes, and the next one becomes the earliest. Recomputation per step is capped at
``prefill_chunk_tokens`` tokens (at least one preempted row per step) so it does not stall the other rows.

Locks: :meth:`plan` runs in the target thread between forward passes, under the session table's lock (every
change of a page table from the event loop's side holds that lock too), never under the runner's forward lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import Counter

from specdec_runtime.cloud_verifier.kv.prefix_cache import cache_prefilled
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.common.errors import CapacityError

PREEMPTIONS = Counter("specdec_kv_preemptions", "Sessions whose KV pages were dropped for an earlier admitted "
                      "session's rows (recompute preemption; their next row recomputes the KV)")
# a deferred row gives up (CapacityError, RESOURCE_EXHAUSTED as before preemption) when no forward pass has run
# for STALL_S while it waited (the pages are held by idle sessions admitted before it: nothing will free them
# soon), or after MAX_WAIT_S in all
STALL_S = 1.0
MAX_WAIT_S = 60.0

RECOMPUTED_TOKENS = Counter("specdec_kv_recomputed_tokens", "Positions whose KV was recomputed after a preemption")


@dataclass
class Planned:
    """The outcome of :meth:`KVScheduler.plan`: ``rows`` (one per ``runnable`` item, in its order),
    ``deferred`` items (no pages this step), and per runnable item the position its row starts recomputing
    from (None: no recomputation)."""

    runnable: list
    rows: list[ForwardRow]
    deferred: list
    rebuilt_from: list[int | None]


def context_ids(work) -> list[int]:
    """Token ids of every position before ``work``'s row: an ExtendSession turn's history while it is prefilled
    (``kv.pending_ids``), else the session's committed ids."""
    kv = work.session.kv
    return kv.pending_ids if kv.pending_ids is not None else work.session.record.committed_token_ids


class KVScheduler:
    """Page allocation (and preemption) for the batcher's forward passes.

    Args:
        target: the :class:`cloud_verifier.target.runner.TargetRunner` (its pool, prefix cache, ``ensure``, ``preempt``).
        sessions: the :class:`cloud_verifier.session.table.SessionTable` (its lock, ``resident_kvs``,
            ``prefill_chunk_tokens``).
        preemption: False: a row that finds no pages is deferred, nobody is preempted (tests show it bites).
    """

    def __init__(self, target, sessions, preemption: bool = True):
        self.target = target
        self.sessions = sessions
        self.preemption = preemption
        self.num_preemptions = 0
        self.last_run = time.monotonic()  # when a plan last had rows to run, monotonic s

    def plan(self, batch: list) -> Planned:
        """Pages for every item of ``batch`` (batcher Work items), earliest admitted session first; the
        :class:`Planned` rows to run. Never raises CapacityError: an item without pages is deferred."""
        runnable, deferred, rebuilt = [], [], []
        budget = self.sessions.prefill_chunk_tokens
        with self.sessions.lock:
            victims = sorted(self.sessions.resident_kvs(), key=lambda kv: kv.order)  # latest admitted last
            granted: set[int] = set()
            for work in sorted(batch, key=lambda w: w.session.kv.order):
                kv = work.session.kv
                start = None
                if not self.target.state_reaches(kv, work.start_position if kv.rebuild_from is None
                                                 else kv.rebuild_from):
                    kv.rebuild_from = 0  # a hybrid's recurrent state is not held there: recompute it all
                if kv.rebuild_from is not None:
                    if not kv.pages:
                        self._take_cached(work)
                    start = kv.rebuild_from
                    recompute = work.start_position - start
                    if any(r is not None for r in rebuilt) and recompute > budget:
                        deferred.append(work)  # recomputation capped per step: the other rows go on
                        continue
                if not self._grow(kv, work.start_position + len(work.tokens), granted, victims):
                    deferred.append(work)
                    continue
                granted.add(id(kv))
                runnable.append(work)
                rebuilt.append(start)
                if start is not None:
                    budget -= work.start_position - start
        rows = []
        for work, start in zip(runnable, rebuilt):
            logits = "all" if work.block is not None else "none"
            layers = tuple(work.features.layers) if work.features is not None else None
            if start is None:
                rows.append(ForwardRow(work.session.kv, work.tokens, work.start_position, logits, layers))
                continue
            recomputed = list(context_ids(work)[start : work.start_position])
            RECOMPUTED_TOKENS.inc(len(recomputed))
            tail = len(work.tokens) if work.block is not None else "none"
            rows.append(ForwardRow(work.session.kv, recomputed + list(work.tokens), start, tail, layers))
            work.session.kv.rebuild_from = None  # the row writes every position from ``start``
        if runnable:
            self.last_run = time.monotonic()
        return Planned(runnable, rows, deferred, rebuilt)

    def give_up(self, work, waiting_since: float) -> CapacityError | None:
        """The error to answer a deferred ``work`` with, or None to keep it waiting: no forward pass ran for
        :data:`STALL_S` s while it waited (every page is held by idle sessions admitted before it), or it waited
        :data:`MAX_WAIT_S` s in all. ``waiting_since``: its first deferral, monotonic s."""
        now = time.monotonic()
        if now - max(waiting_since, self.last_run) < STALL_S and now - waiting_since < MAX_WAIT_S:
            return None
        pool = self.target.kv_pool.pages
        return CapacityError(f"KV cache full: no KV pages for {len(work.tokens)} positions within "
                             f"{now - waiting_since:.1f} s ({pool.num_used} of {pool.num_pages} pages held by "
                             f"sessions admitted before this one)")

    def _take_cached(self, work) -> None:
        """A preempted table with no page takes back the longest cached prefix of the positions before the
        row (never past them: those are the row's to write)."""
        kv, cache = work.session.kv, self.target.prefix_cache
        kv.rebuild_from = 0
        if cache is None or not cache.enabled:
            return
        bs = cache.page_size
        n = work.start_position // bs
        ids = context_ids(work)[: n * bs]
        taken = cache.take_prefix(cache.page_hashes(ids, work.session.record.tenant_id), n)
        kv.pages.extend(taken)
        kv.rebuild_from = len(taken) * bs

    def _grow(self, kv, tokens: int, granted: set[int], victims: list) -> bool:
        """Pages for positions 0..tokens-1 of ``kv``, preempting the latest admitted sessions ranked after it
        (and not granted this step) while the pool is short. False: still short (nothing more to preempt)."""
        while True:
            try:
                self.target.ensure(kv, tokens)
                return True
            except CapacityError:
                if not self.preemption:
                    return False
            victim = None
            while victims:
                candidate = victims.pop()
                if candidate.order <= kv.order:
                    victims.append(candidate)
                    break
                if candidate.pages and id(candidate) not in granted and not candidate.freed:
                    victim = candidate
                    break
            if victim is None:
                return False
            self.target.preempt(victim)
            self.num_preemptions += 1
            PREEMPTIONS.inc()

    def undo(self, planned: Planned) -> None:
        """The forward pass raised: the rows that recomputed positions are marked preempted again from where
        they started (what the pass wrote is unknown)."""
        for work, start in zip(planned.runnable, planned.rebuilt_from):
            if start is not None:
                work.session.kv.rebuild_from = start

    def after_forward(self, planned: Planned) -> None:
        """The forward pass ran: each item that asked for features gets its tokens' (``Work.hidden``; a
        prefill chunk's go to its session's ``prefill_hidden`` too); the full pages a recomputing row rebuilt
        that hold committed tokens go back into the prefix cache (sessions opening from now on, or this one's
        next preemption, find them)."""
        for work, row in zip(planned.runnable, planned.rows):
            if row.hidden is not None:  # a rebuilt row recomputed positions before the item's own
                work.hidden = row.hidden[len(row.token_ids) - len(work.tokens):]
                if work.block is None:
                    work.session.prefill_hidden.append((work.start_position, work.hidden))
        for work, start in zip(planned.runnable, planned.rebuilt_from):
            if start is None:
                continue
            record = work.session.record
            upto = min(work.start_position, record.committed_length - 1)
            with self.sessions.lock:
                cache_prefilled(self.target, work.session.kv, record.committed_token_ids, upto, record.tenant_id)
