"""The session table of one verifier replica: the sessions it holds and their life cycle.

- **Admission, prefill, resume, extend** (sessions coming onto the replica): :mod:`cloud_verifier.session.admission`.
- **Blocks in flight**: one block of a session at a time (:meth:`SessionTable.block_in_flight`); a verdict whose
  store commit got no answer is settled from the store at the next request (:meth:`SessionTable.settle`).
- **Release**: closing, expiry or a stale copy removes a session from the table at once; its KV cache is
  freed at once too, unless one of its blocks is queued or in a forward pass: then it is freed as soon as that
  block is done (never under a running forward pass).
- **Reaping**: sessions idle for more than ``session_ttl_s`` seconds, or whose store record expired, are freed.
- **Gauges**: open sessions, KV bytes and pages in use (:mod:`cloud_verifier.metrics`).

The store record is the source of truth for committed tokens; the table keeps this replica's copy of it, its
KV cache and its stopping state (:class:`cloud_verifier.session.state.Session`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from specdec_runtime.cloud_verifier.session.request_log import log_session_end
from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.session.admission import PrefillChunk, SessionAdmission
from specdec_runtime.cloud_verifier.kv.prefix_cache import cache_committed
from specdec_runtime.cloud_verifier.session.state import Session
from specdec_runtime.cloud_verifier.store import SessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.common.errors import SessionNotFoundError, SpecdecError
from specdec_runtime.common.types import SamplingParams, ServedInfo, StoppingCriteria, Verdict

__all__ = ["PrefillChunk", "Session", "SessionTable"]  # Session, PrefillChunk: re-exported from their modules

log = logging.getLogger(__name__)

_MOVED_GRACE_S = 5.0  # a copy whose session another replica holds is dropped once idle this long, s


class SessionTable:
    """The sessions held by one replica; opening, resuming and extending them is its ``admission``
    (:class:`~cloud_verifier.session.admission.SessionAdmission`, which keeps the sessions on their way in).

    Args:
        target: the target runner (KV cache budget).
        store: the session store (records, claims on resume, deletes).
        info: what this replica serves (``verifier_id``, ``model_id``, ``max_context_tokens``).
        eos_token_ids: the target's end-of-sequence token ids (stopping).
        prefill_chunk: runs one prefill chunk through the batcher.
        max_sessions: open sessions allowed on this replica, sessions being opened included.
        prefill_chunk_tokens: prompt tokens prefilled per forward pass, tokens.
        session_ttl_s: idle time after which a session is freed, s.
        ledger: the acceptance per draft version (cloud_verifier.drafts.ledger.AcceptanceLedger): a session
            opened or resumed here counts under its record's draft version; None = nothing counted per version.
    """

    def __init__(
        self,
        target: TargetRunner,
        store: SessionStore,
        info: ServedInfo,
        eos_token_ids: set[int],
        prefill_chunk: PrefillChunk,
        *,
        max_sessions: int,
        prefill_chunk_tokens: int,
        session_ttl_s: float,
        ledger=None,
    ):
        self.target = target
        self.store = store
        self.info = info
        self.eos_token_ids = eos_token_ids
        self.prefill_chunk = prefill_chunk
        self.max_sessions = max_sessions
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.session_ttl_s = session_ttl_s
        self.ledger = ledger
        self._sessions: dict[str, Session] = {}
        # public: admission and the KV scheduler (preemption) change page tables and held sessions under it too
        self.lock = threading.Lock()
        self.admission = SessionAdmission(self)
        metrics.KV_CACHE_CAPACITY_BYTES.set(target.kv_cache_budget_tokens * target.kv_bytes_per_token)
        metrics.KV_CACHE_PAGES_TOTAL.set(target.kv_pool.num_pages)

    @property
    def num_sessions(self) -> int:
        """Sessions held (prefilled) on this replica."""
        return len(self._sessions)

    def held(self, session_id: str) -> Session | None:
        """The session if this replica holds it (no resume), else None."""
        return self._sessions.get(session_id)

    def resident_kvs(self) -> list:
        """The KV caches of every session held or being prefilled here (what preemption may drop); call under
        the table's lock."""
        return [s.kv for s in self._sessions.values()] + self.admission.loading_kvs()

    def hold(self, session: Session) -> None:
        """Hold an admitted, prefilled session (:class:`~cloud_verifier.session.admission.SessionAdmission`); call under
        the table's lock."""
        self._sessions[session.record.session_id] = session

    async def open(self, prompt: list[int], sampling: SamplingParams, stopping: StoppingCriteria,
                   tenant_id: str = "", num_output_tokens: int = 0, features=None, draft_label: str = "") -> Session:
        """A new session: :meth:`SessionAdmission.open <cloud_verifier.session.admission.SessionAdmission.open>`."""
        return await self.admission.open(prompt, sampling, stopping, tenant_id, num_output_tokens, features,
                                         draft_label)

    async def get_or_resume(self, session_id: str, tenant_id: str | None = None, features=None,
                            features_from: int | None = None) -> Session:
        """The session held here, or resumed from the store (keeping the features a block asks from
        ``features_from``): :meth:`SessionAdmission.get_or_resume
        <cloud_verifier.session.admission.SessionAdmission.get_or_resume>`."""
        return await self.admission.get_or_resume(session_id, tenant_id, features, features_from)

    async def extend(self, session: Session, expected_length: int, appended: list[int], sampling: SamplingParams,
                     stopping: StoppingCriteria, features=None) -> Session:
        """The next turn of a session: :meth:`SessionAdmission.extend
        <cloud_verifier.session.admission.SessionAdmission.extend>`."""
        return await self.admission.extend(session, expected_length, appended, sampling, stopping, features)

    def tenant_session_count(self, tenant_id: str) -> int:
        """Sessions of ``tenant_id`` held (prefilled) on this replica."""
        with self.lock:
            return sum(1 for s in self._sessions.values() if s.record.tenant_id == tenant_id)

    # ------------------------------------------------------------------ blocks in flight, release
    @contextlib.contextmanager
    def block_in_flight(self, session: Session, validate: Callable[[], None]) -> Iterator[None]:
        """Mark one block of ``session`` in flight for the ``with`` body (its verification).

        ``validate`` (block validation) runs first, under the table's lock, so no other block of the session
        can slip in between the checks and the mark; then the session's page table grows to hold the positions
        the largest block may write (committed + max_num_speculative_tokens, capped by its limit). On exit: the
        session's last-seen time is updated, its rejected tail rolled back (whole pages past the committed
        length freed), and a session released meanwhile gets its KV cache freed now (the deferred release).

        Raises:
            whatever ``validate`` raises; SessionNotFoundError: the session was closed. A pool short of free
            pages is no error here: the batcher gets them before the forward pass (:mod:`cloud_verifier.kv.scheduler`).
        """
        with self.lock:
            validate()
            if session.released:
                raise SessionNotFoundError(f"session {session.record.session_id!r} was closed")
            kv = session.kv
            # best effort: a pool short now leaves it to the batcher, which preempts later sessions if it must
            self.target.try_ensure(kv, min(kv.capacity, session.record.committed_length
                                           + self.info.max_num_speculative_tokens))
            session.busy = True
        try:
            yield
        finally:
            self.end_busy(session)

    def end_busy(self, session: Session) -> None:
        """The end of what made ``session`` busy (a block, or an ExtendSession turn's prefill): not busy, seen
        now, its KV cache freed now when it was released meanwhile (the deferred release), its idle waiters
        (:meth:`wait_idle`) woken."""
        with self.lock:
            session.busy = False
            session.last_seen = time.time()
            if session.released:  # closed while busy: free it now
                self.target.free(session.kv)
            elif session.unconfirmed is None:  # roll back: the KV holds committed[:-1]; a verdict that may
                # have landed keeps its positions until it is settled
                self.target.truncate(session.kv, session.record.committed_length - 1)
            waiters, session.idle_waiters = session.idle_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)
        self.update_gauges()

    async def wait_idle(self, session: Session, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` s) until no block of ``session`` is queued or in a forward pass, e.g. the
        block of a stream its client cancelled and resent at once. Returns True when idle."""
        if not session.busy:
            return True
        waiter = asyncio.get_running_loop().create_future()
        session.idle_waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        return not session.busy

    async def session_for_block(self, session_id: str, seq: int, committed_length: int, tenant_id: str,
                                busy_wait_s: float, block=None) -> tuple[Session, Verdict | None]:
        """The session a block goes to, and the verdict to answer it with when the block is a retry of one whose
        commit landed although the store's answer was lost (None otherwise). The session: held here or resumed
        from the store; after the previous block of the session has ended (at most ``busy_wait_s``, s); its
        unanswered commit settled from the store; and resumed afresh from the store when this replica's copy
        disagrees with the block because the store moved on without it (the session continued on another
        replica, e.g. behind a balancer). Another tenant's session is not found (checked before any resume).
        ``block`` (a common.types.DraftBlock, features resolved): a resume for it keeps the features it asks
        from ``block.features_from`` (:meth:`SessionAdmission.get_or_resume
        <cloud_verifier.session.admission.SessionAdmission.get_or_resume>`).

        Raises:
            VerifierUnavailableError: the session has an unanswered commit and the store still does not answer.
        """
        asks = {} if block is None else {"features": block.features, "features_from": block.features_from}

        async def resume() -> Session:
            return await self.get_or_resume(session_id, tenant_id, **asks)

        session = await resume()
        if session.busy:
            await self.wait_idle(session, busy_wait_s)
            if session.released:  # its block's commit was refused (stale copy): the store has the truth
                session = await resume()
        if session.unconfirmed is not None and not session.busy:
            landed = self.settle(session)
            if landed is not None and landed.seq == seq and \
                    landed.committed_length - len(landed.committed_token_ids) == committed_length:
                return session, landed
            if session.released:
                session = await resume()
        r = session.record
        if ((committed_length != r.committed_length or seq != r.last_seq + 1) and not session.busy
                and self.is_stale(session)):
            self.release(session_id)
            session = await resume()
        return session, None

    def settle(self, session: Session) -> Verdict | None:
        """Settle ``session.unconfirmed``, a verdict whose store commit got no answer, from the store: it landed
        (the store holds its tokens after the copy's committed length, with its seq: applied to the copy, the
        stopping state included, and returned, so a retry of its block is answered with it), or it did not (the
        copy is as before the block: None). A store that moved on otherwise (another replica, expiry) makes the
        copy stale: released (None).

        Raises:
            VerifierUnavailableError: the store still does not answer (the verdict stays unconfirmed).
        """
        verdict = session.unconfirmed
        if verdict is None:
            return None
        record = self.store.get(session.record.session_id)
        session.unconfirmed = None
        mine = record is not None and record.verifier_id == self.info.verifier_id
        if mine and record.committed_token_ids == session.committed + verdict.committed_token_ids \
                and record.last_seq == verdict.seq:
            session.stop.append(verdict.committed_token_ids)
            session.confirm(verdict)
            return verdict
        if not (mine and record.committed_token_ids == session.committed):
            self.release(session.record.session_id)
        return None

    def is_stale(self, session: Session) -> bool:
        """True when the store moved on without this replica's copy of ``session``: another replica holds it,
        or its committed tokens differ (the store is the source of truth). A store that does not answer, or a
        session gone from it, counts as not stale (the caller's own error stands)."""
        try:
            record = self.store.get(session.record.session_id)
        except SpecdecError:
            return False
        if record is None:
            return False
        return (record.verifier_id != self.info.verifier_id
                or record.committed_length != session.record.committed_length)

    def disown_all(self) -> int:
        """Give up every session held here in the store (graceful shutdown), so another replica resumes each at
        its next block; the local copies stay until freed. Returns how many were given up; store errors are
        logged (the sessions stay claimable: a claim moves them anyway)."""
        with self.lock:
            ids = list(self._sessions)
        given_up = 0
        for sid in ids:
            try:
                given_up += bool(self.store.disown(sid, self.info.verifier_id))
            except SpecdecError as e:
                log.warning("could not give up session %s: %s", sid, e)
                break
        return given_up

    def release(self, session_id: str, how: str = "released") -> Session | None:
        """Remove a session from this replica and free its KV cache — at once, or, when one of its blocks is
        queued or in a forward pass, as soon as that block is done (never under a running batch). The store
        record is untouched. Returns the session, or None when this replica did not hold it. Logs the session's
        line (:mod:`cloud_verifier.session.request_log`; ``how``: "closed", "reaped" or "released")."""
        with self.lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return None
            session.released = True
            if not session.busy:
                self.target.free(session.kv)
        self.update_gauges()
        log_session_end(session, how)
        return session

    def cache_committed(self, session: Session) -> None:
        """Share the KV pages a verify commit of ``session`` filled (its full pages below committed length - 1,
        final: no later forward pass of it writes there) through the prefix cache, at once rather than at its
        next ExtendSession: a session sending this conversation (a retried or forked chat) prefills only its tail.
        Runs in the target thread after the store commit; a failure here is logged, never the verdict's."""
        record = session.record
        try:
            cache_committed(self.target, session.kv, record.committed_token_ids, record.tenant_id)
        except Exception:  # noqa: BLE001 - the commit is done; caching is an optimisation
            log.exception("could not cache the committed pages of session %s", record.session_id)

    def close(self, session_id: str) -> bool:
        """Release the session here and delete its store keys; False if it existed in neither."""
        session = self.release(session_id, "closed")
        if session is not None:
            metrics.SESSIONS_CLOSED.inc()
        existed = self.store.delete(session_id)
        return existed or session is not None

    def free_all(self) -> None:
        """Free every session's KV cache (their store records stay, so another replica can resume them)."""
        with self.lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            self.target.free(s.kv)
        self.update_gauges()

    # ------------------------------------------------------------------ reaping, gauges
    def reap_expired(self, now: float | None = None) -> int:
        """Free sessions idle for longer than the TTL (and those whose store record expired); ``now``: unix
        time, s (default: the clock). Sessions with a block in flight are skipped. Returns the count. Copies of
        sessions another replica now holds are dropped too (not counted)."""
        now = time.time() if now is None else now
        with self.lock:
            candidates = [s for s in self._sessions.values() if not s.busy]
        reaped = 0
        for s in candidates:
            sid = s.record.session_id
            record = self.store.get(sid)
            if record is not None and record.verifier_id != self.info.verifier_id:
                if now - s.last_seen > _MOVED_GRACE_S:  # not one being resumed here right now (claimed after)
                    self.release(sid)  # resumed on another replica (failover, balancer): this copy is stale
                continue
            if now - s.last_seen > self.session_ttl_s or record is None:
                gone = self.release(sid, "reaped")
                if gone is not None:
                    self.store.delete(sid, verifier_id=self.info.verifier_id)
                    metrics.SESSIONS_EXPIRED.inc()
                    reaped += 1
        if reaped:
            self.update_gauges()
        return reaped

    async def reap_loop(self, interval_s: float) -> None:
        """Run :meth:`reap_expired` every ``interval_s`` seconds (in a worker thread: the store may block)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            try:
                await loop.run_in_executor(None, self.reap_expired)
                if not self._sessions and not self.admission.num_opening:  # idle: freed heap memory back (RSS)
                    await loop.run_in_executor(None, self.target.release_idle_memory)
            except SpecdecError as e:  # e.g. the store is unreachable: one line, retried next period
                log.warning("reaper: %s", e)
            except Exception:
                log.exception("reaper failed")

    def update_gauges(self) -> None:
        """The sessions and KV gauges (:mod:`cloud_verifier.metrics`) from the table's state now."""
        metrics.SESSIONS_OPEN.set(len(self._sessions))
        metrics.KV_CACHE_USED_BYTES.set(self.target.kv_reserved_bytes)
        metrics.KV_CACHE_PAGES_USED.set(self.target.kv_pool.pages.num_used)
