"""The session table of one verifier replica: per-session state and its life cycle.

- **Admission**: at most ``max_sessions`` sessions per replica, sessions being opened (prefilled) included;
  each session reserves a KV cache of ``prompt + max_new_tokens`` tokens (capped by the context) from the
  target's budget. Past either limit a session is refused (:class:`~common.errors.CapacityError`) rather than
  slowing the others down.
- **Prefill**: the committed tokens but the last are prefilled in chunks of ``prefill_chunk_tokens``, each
  chunk through the batcher (one chunk per forward pass, interleaved with other sessions' verify steps).
- **Resume**: a session unknown here but present in the store (its replica crashed or drained) is rebuilt by
  prefilling its committed tokens, then claimed in the store. Concurrent requests for the same session share
  one resume (one prefill).
- **Release**: closing, expiry or a stale copy removes a session from the table at once; its KV cache is
  freed at once too, unless one of its blocks is queued or in a forward pass: then it is freed as soon as that
  block is done (never under a running forward pass).
- **Reaping**: sessions idle for more than ``session_ttl_s`` seconds, or whose store record expired, are freed.
- **Gauges**: open sessions and reserved KV bytes (:mod:`cloud_verifier.metrics`).

The store record is the source of truth for committed tokens; the table keeps this replica's copy of it, its
KV cache and its stopping state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from cloud_verifier import metrics
from cloud_verifier.store import SessionRecord, SessionStore
from cloud_verifier.target import SessionKV, TargetRunner
from common.errors import CapacityError, InvalidRequestError, PreconditionError, SessionNotFoundError, SpecdecError
from common.stopping import StopChecker
from common.types import SamplingParams, ServedInfo, StoppingCriteria, Verdict

log = logging.getLogger(__name__)

_MOVED_GRACE_S = 5.0  # a copy whose session another replica holds is dropped once idle this long, s


@dataclass
class Session:
    """This replica's state of one session."""

    record: SessionRecord  # this replica's copy of the store record (committed tokens, seq, finish state)
    kv: SessionKV  # the target KV cache, ``capacity`` tokens
    stop: StopChecker  # stopping state over the committed output
    busy: bool = False  # a block of this session is queued or running
    released: bool = False  # closed/expired: KV freed, or to be freed when the block in flight is done
    last_seen: float = field(default_factory=time.time)  # unix time of the last block's end, s
    idle_waiters: list = field(default_factory=list)  # asyncio futures resolved when ``busy`` turns False
    # a verdict whose store commit got no answer (it may or may not have landed): settled at the next request
    unconfirmed: Verdict | None = None

    @property
    def committed(self) -> list[int]:
        """Committed token ids (prompt + output)."""
        return self.record.committed_token_ids

    def confirm(self, verdict: Verdict) -> None:
        """Apply a verdict the store committed to this replica's copy of the record (ids, seq, finish state)."""
        r = self.record
        r.committed_token_ids.extend(verdict.committed_token_ids)
        r.last_seq = verdict.seq
        r.finished, r.finish_reason = verdict.finished, verdict.finish_reason


def _owned(session: Session, session_id: str, tenant_id: str | None) -> Session:
    """``session`` if it belongs to ``tenant_id`` (None = not checked).

    Raises:
        SessionNotFoundError: another tenant's session (the same message as an unknown one).
    """
    if tenant_id is not None and session.record.tenant_id != tenant_id:
        raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
    return session


# Runs one prefill chunk of a session: (session, token ids, start position) -> None once the chunk is in its
# KV cache. The batcher's ``prefill``.
PrefillChunk = Callable[[Session, list[int], int], Awaitable[None]]


class SessionTable:
    """The sessions held by one replica.

    Args:
        target: the target runner (KV cache budget).
        store: the session store (records, claims on resume, deletes).
        info: what this replica serves (``verifier_id``, ``model_id``, ``max_context_tokens``).
        eos_token_ids: the target's end-of-sequence token ids (stopping).
        prefill_chunk: runs one prefill chunk through the batcher.
        max_sessions: open sessions allowed on this replica, sessions being opened included.
        prefill_chunk_tokens: prompt tokens prefilled per forward pass, tokens.
        session_ttl_s: idle time after which a session is freed, s.
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
    ):
        self.target = target
        self.store = store
        self.info = info
        self.eos_token_ids = eos_token_ids
        self.prefill_chunk = prefill_chunk
        self.max_sessions = max_sessions
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.session_ttl_s = session_ttl_s
        self._sessions: dict[str, Session] = {}
        self._resuming: dict[str, asyncio.Future] = {}  # session id -> resume in progress
        self._opening = 0  # sessions being prefilled (count towards max_sessions)
        self._lock = threading.Lock()
        metrics.KV_CACHE_CAPACITY_BYTES.set(target.kv_cache_budget_tokens * target.kv_bytes_per_token)

    @property
    def num_sessions(self) -> int:
        """Sessions held (prefilled) on this replica."""
        return len(self._sessions)

    def held(self, session_id: str) -> Session | None:
        """The session if this replica holds it (no resume), else None."""
        return self._sessions.get(session_id)

    def tenant_session_count(self, tenant_id: str) -> int:
        """Sessions of ``tenant_id`` held (prefilled) on this replica."""
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.record.tenant_id == tenant_id)

    # ------------------------------------------------------------------ open, resume
    async def open(self, prompt: list[int], sampling: SamplingParams, stopping: StoppingCriteria,
                   tenant_id: str = "") -> Session:
        """Admit a new session (a fresh id; a random seed when ``sampling.seed`` is None), prefill ``prompt``
        (validated token ids) and create its store record.

        Raises:
            CapacityError: max_sessions reached or no KV budget left.
            VerifierUnavailableError: shutting down, or the store is unreachable (nothing stays reserved).
        """
        if sampling.seed is None:
            sampling = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, secrets.randbits(63))
        now = time.time()
        record = SessionRecord(
            session_id=secrets.token_hex(12),
            verifier_id=self.info.verifier_id,
            model_id=self.info.model_id,
            prompt_length=len(prompt),
            committed_token_ids=list(prompt),
            sampling=sampling,
            stopping=stopping,
            seed=int(sampling.seed),
            created_at=now,
            last_seen_at=now,
            tenant_id=tenant_id,
        )
        session = await self._load(record)
        try:
            self.store.create(dataclasses.replace(record, committed_token_ids=list(prompt)))
        except BaseException:  # store unreachable: nothing may stay reserved for a session nobody can use
            self.release(record.session_id)
            raise
        metrics.SESSIONS_OPENED.inc()
        return session

    async def get_or_resume(self, session_id: str, tenant_id: str | None = None) -> Session:
        """The session held here, or resumed from the store (concurrent callers share one resume).

        Raises:
            SessionNotFoundError: unknown or expired in the store, or expired while being resumed.
            PreconditionError: the stored session is for another model.
            CapacityError: no room to resume it here.
        """
        session = self._sessions.get(session_id)
        if session is not None:
            return _owned(session, session_id, tenant_id)
        pending = self._resuming.get(session_id)
        if pending is not None:  # another request is already resuming it: share that prefill
            return _owned(await asyncio.shield(pending), session_id, tenant_id)
        future = asyncio.get_running_loop().create_future()
        self._resuming[session_id] = future
        try:
            session = await self._resume(session_id, tenant_id)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved
            raise
        else:
            future.set_result(session)
            return session
        finally:
            del self._resuming[session_id]

    async def _resume(self, session_id: str, tenant_id: str | None = None) -> Session:
        record = self.store.get(session_id)
        if record is None or (tenant_id is not None and record.tenant_id != tenant_id):  # before any prefill
            raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
        if record.model_id != self.info.model_id:
            raise PreconditionError(f"session {session_id} is for model {record.model_id}, not {self.info.model_id}")
        log.info("resuming session %s from the store (was on %s)", session_id, record.verifier_id)
        record.verifier_id = self.info.verifier_id
        session = await self._load(record)
        if not self.store.claim(session_id, self.info.verifier_id, time.time()):
            self.release(session_id)
            raise SessionNotFoundError(f"session {session_id!r} expired while being resumed")
        metrics.SESSIONS_RESUMED.inc()
        return session

    async def _load(self, record: SessionRecord) -> Session:
        """Admit ``record`` (max_sessions, counting sessions being opened), then prefill it."""
        with self._lock:
            if len(self._sessions) + self._opening >= self.max_sessions:
                raise CapacityError(f"verifier full: {len(self._sessions)} of {self.max_sessions} sessions open")
            self._opening += 1
        try:
            return await self._prefill(record)
        finally:
            with self._lock:
                self._opening -= 1

    async def _prefill(self, record: SessionRecord) -> Session:
        """Reserve the KV cache, prefill ``record``'s committed tokens except the last (in chunks), add the
        session to the table. The last committed token is fed with the first block."""
        capacity = min(self.info.max_context_tokens, record.prompt_length + record.stopping.max_new_tokens)
        kv = self.target.allocate(capacity)
        stop = StopChecker(
            self.target.tokenizer, record.stopping, self.eos_token_ids, record.prompt_length,
            self.info.max_context_tokens,
        )
        generated = record.committed_token_ids[record.prompt_length :]
        if generated:
            stop.append(generated)
        session = Session(record=record, kv=kv, stop=stop, busy=True)
        try:
            prefix = record.committed_token_ids[:-1]
            for begin in range(0, len(prefix), self.prefill_chunk_tokens):
                await self.prefill_chunk(session, prefix[begin : begin + self.prefill_chunk_tokens], begin)
        except BaseException:
            self.target.free(kv)
            raise
        session.busy = False
        with self._lock:
            self._sessions[record.session_id] = session
        self._update_gauges()
        return session

    # ------------------------------------------------------------------ extend (multi-turn sessions)
    async def extend(self, session: Session, expected_length: int, appended: list[int], sampling: SamplingParams,
                     stopping: StoppingCriteria) -> Session:
        """Continue a finished (or not started) session with the next turn of its conversation: grow its KV
        cache to ``committed + appended + stopping.max_new_tokens`` tokens (capped by the context) when needed,
        prefill only the new tokens (the last committed token, then ``appended`` but its last, in chunks of
        ``prefill_chunk_tokens``; the KV cache of everything before stays), then commit the turn in the store
        (compare-and-append on ``expected_length``) and reset the stopping state: the new turn's output starts
        at the new committed length. ``appended``: validated token ids; ``sampling`` with the seed to draw with.

        Nothing committed changes on any error (positions the prefill wrote lie past the committed length,
        where the next forward pass overwrites them).

        Raises:
            ConflictError: ``expected_length`` differs from the session's committed length.
            PreconditionError: the session is generating (finished = False and output committed).
            SessionNotFoundError: the session was closed, or expired in the store.
            CapacityError: no KV budget for the longer session (nothing stays reserved).
            InvalidRequestError: another replica took the session meanwhile (stale copy: released here).
            VerifierUnavailableError: shutting down, or the store is unreachable.
        """
        from cloud_verifier.store import extend_conflict, generating_error

        record = session.record
        sid = record.session_id
        with self._lock:
            if session.released:
                raise SessionNotFoundError(f"session {sid!r} was closed")
            if record.committed_length != expected_length:
                raise extend_conflict(sid, expected_length, record.committed_length)
            if not record.finished and record.committed_length != record.prompt_length:
                raise generating_error(sid)
            if session.busy:
                raise PreconditionError(f"session {sid!r} has a block in flight")
            session.busy = True  # no block can slip in while the turn is prefilled
        try:
            start = record.committed_length - 1  # the KV cache holds committed[:-1]
            new_length = record.committed_length + len(appended)
            needed = min(self.info.max_context_tokens, new_length + stopping.max_new_tokens)
            if session.kv.capacity < needed:
                self._grow(session, needed, start)
            tokens = [record.committed_token_ids[-1], *appended[:-1]]
            for begin in range(0, len(tokens), self.prefill_chunk_tokens):
                await self.prefill_chunk(session, tokens[begin : begin + self.prefill_chunk_tokens], start + begin)
            now = time.time()
            self.store.extend(sid, expected_length, appended, sampling, stopping, int(sampling.seed), now,
                              self.info.verifier_id)
            record.committed_token_ids.extend(appended)
            record.prompt_length = new_length
            record.sampling, record.stopping, record.seed = sampling, stopping, int(sampling.seed)
            record.finished, record.finish_reason = False, None
            record.last_seen_at = now
            session.stop = StopChecker(self.target.tokenizer, stopping, self.eos_token_ids, new_length,
                                       self.info.max_context_tokens)
        except (SessionNotFoundError, InvalidRequestError):
            self.release(sid)  # gone from the store, or held elsewhere: this copy is stale
            raise
        finally:
            with self._lock:
                session.busy = False
                session.last_seen = time.time()
                if session.released:
                    self.target.free(session.kv)
                waiters, session.idle_waiters = session.idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
        return session

    def _grow(self, session: Session, capacity: int, keep: int) -> None:
        """Move the session's KV cache to a buffer of ``capacity`` tokens, copying its first ``keep`` positions
        (the session is marked busy: no forward pass uses its cache meanwhile).

        Raises:
            CapacityError: the budget has no room for the larger buffer (the old one stays).
        """
        kv = self.target.allocate(capacity)
        old = session.kv.buffer
        if keep > 0:
            kv.buffer[:, :, :, :keep].copy_(old[:, :, :, :keep])
        self.target.free(session.kv)  # empties the old SessionKV object
        session.kv.buffer = kv.buffer  # the session keeps its SessionKV object (rows may refer to it)
        self._update_gauges()

    # ------------------------------------------------------------------ blocks in flight, release
    @contextlib.contextmanager
    def block_in_flight(self, session: Session, validate: Callable[[], None]) -> Iterator[None]:
        """Mark one block of ``session`` in flight for the ``with`` body (its verification).

        ``validate`` (block validation) runs first, under the table's lock, so no other block of the session
        can slip in between the checks and the mark. On exit: the session's last-seen time is updated, and a
        session released meanwhile gets its KV cache freed now (the deferred release).

        Raises:
            whatever ``validate`` raises; SessionNotFoundError: the session was closed.
        """
        with self._lock:
            validate()
            if session.released:
                raise SessionNotFoundError(f"session {session.record.session_id!r} was closed")
            session.busy = True
        try:
            yield
        finally:
            with self._lock:
                session.busy = False
                session.last_seen = time.time()
                if session.released:  # closed while its block was in flight: free it now
                    self.target.free(session.kv)
                waiters, session.idle_waiters = session.idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
            if session.released:
                self._update_gauges()

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
        with self._lock:
            ids = list(self._sessions)
        given_up = 0
        for sid in ids:
            try:
                given_up += bool(self.store.disown(sid, self.info.verifier_id))
            except SpecdecError as e:
                log.warning("could not give up session %s: %s", sid, e)
                break
        return given_up

    def release(self, session_id: str) -> Session | None:
        """Remove a session from this replica and free its KV cache — at once, or, when one of its blocks is
        queued or in a forward pass, as soon as that block is done (never under a running batch). The store
        record is untouched. Returns the session, or None when this replica did not hold it."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return None
            session.released = True
            if not session.busy:
                self.target.free(session.kv)
        self._update_gauges()
        return session

    def close(self, session_id: str) -> bool:
        """Release the session here and delete its store keys; False if it existed in neither."""
        session = self.release(session_id)
        if session is not None:
            metrics.SESSIONS_CLOSED.inc()
        existed = self.store.delete(session_id)
        return existed or session is not None

    def free_all(self) -> None:
        """Free every session's KV cache (their store records stay, so another replica can resume them)."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            self.target.free(s.kv)
        self._update_gauges()

    # ------------------------------------------------------------------ reaping, gauges
    def reap_expired(self, now: float | None = None) -> int:
        """Free sessions idle for longer than the TTL (and those whose store record expired); ``now``: unix
        time, s (default: the clock). Sessions with a block in flight are skipped. Returns the count. Copies of
        sessions another replica now holds are dropped too (not counted)."""
        now = time.time() if now is None else now
        with self._lock:
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
                gone = self.release(sid)
                if gone is not None:
                    self.store.delete(sid, verifier_id=self.info.verifier_id)
                    metrics.SESSIONS_EXPIRED.inc()
                    reaped += 1
        if reaped:
            self._update_gauges()
        return reaped

    async def reap_loop(self, interval_s: float) -> None:
        """Run :meth:`reap_expired` every ``interval_s`` seconds (in a worker thread: the store may block)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            try:
                await loop.run_in_executor(None, self.reap_expired)
                if not self._sessions and not self._opening:  # idle: freed heap pages back to the OS (RSS)
                    await loop.run_in_executor(None, self.target.release_idle_memory)
            except SpecdecError as e:  # e.g. the store is unreachable: one line, retried next period
                log.warning("reaper: %s", e)
            except Exception:
                log.exception("reaper failed")

    def _update_gauges(self) -> None:
        metrics.SESSIONS_OPEN.set(len(self._sessions))
        metrics.KV_CACHE_USED_BYTES.set(self.target.kv_reserved_bytes)
