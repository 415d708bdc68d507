"""Sessions coming onto a replica: admission, prefill, resume from the store, and the next turn of a
multi-turn session (ExtendSession). :class:`SessionAdmission` is owned by a replica's
:class:`cloud_verifier.session.table.SessionTable` (which holds the sessions once admitted) and keeps its own state:
the sessions being opened, resumed or prefilled.

- **Admission**: at most ``max_sessions`` sessions per replica, sessions being opened (prefilled) included;
  each session takes KV pages from the target's paged pool (:mod:`cloud_verifier.kv.pool`) for the tokens it
  actually holds: its prompt at open, more pages as its blocks are verified (:meth:`SessionTable.block_in_flight`),
  whole pages back when a rejected tail is rolled back. Its limit (prompt + ``max_new_tokens``, capped by the
  context) bounds validation, and must fit the whole pool (else refused at open,
  :class:`~common.errors.CapacityError`). Sessions may together need more pages than the pool has: a row
  that finds none waits, and later admitted sessions are preempted for earlier ones
  (:mod:`cloud_verifier.kv.scheduler`); a client sees only delay.
- **Prefill**: the committed tokens but the last are prefilled in chunks of ``prefill_chunk_tokens``, each
  chunk through the batcher (one chunk per forward pass, interleaved with other sessions' verify steps).
- **Resume**: a session unknown here but present in the store (its replica crashed or drained) is rebuilt by
  prefilling its committed tokens, then claimed in the store. Concurrent requests for the same session share
  one resume (one prefill). A block that says ``features_from`` (a draft head lacking features) has the
  re-prefill keep its features from there (:mod:`cloud_verifier.session.features`).
- **Extend**: the next turn's tokens are prefilled after the KV cache of everything before (more pages, no
  copy), then committed to the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.kv.prefix_cache import cache_prefilled, extend_session_kv, open_session_kv
from specdec_runtime.cloud_verifier.session.features import keep_resumed_features
from specdec_runtime.cloud_verifier.session.state import Session, owned
from specdec_runtime.cloud_verifier.store import SessionRecord
from specdec_runtime.common.errors import CapacityError, PreconditionError, SessionNotFoundError, StaleSessionError
from specdec_runtime.common.stopping import StopChecker
from specdec_runtime.common.types import SamplingParams, StoppingCriteria

log = logging.getLogger(__name__)

# Runs one prefill chunk of a session: (session, token ids, start position) -> None once the chunk is in its
# KV cache. The batcher's ``prefill``.
PrefillChunk = Callable[[Session, list[int], int], Awaitable[None]]


class SessionAdmission:
    """Opening, resuming and extending the sessions of one replica.

    Args:
        table: the :class:`cloud_verifier.session.table.SessionTable` the sessions join (not imported here: the table
            owns this object). Used through its public face: ``lock`` (page tables and the held sessions change
            under it), ``held``, ``num_sessions``, ``hold``, ``release``, ``end_busy``, ``update_gauges``, and
            its ``target``, ``store``, ``info``, ``eos_token_ids``, ``prefill_chunk``, ``max_sessions``,
            ``prefill_chunk_tokens``.
    """

    def __init__(self, table):
        self.table = table
        self._resuming: dict[str, asyncio.Future] = {}  # session id -> resume in progress
        self._opening = 0  # sessions being prefilled (count towards max_sessions)
        self._loading: dict[int, Session] = {}  # id -> a session being prefilled (its KV may be preempted)

    @property
    def num_opening(self) -> int:
        """Sessions being opened or resumed (admitted, not prefilled yet)."""
        return self._opening

    def loading_kvs(self) -> list:
        """The KV caches of the sessions being prefilled (preemptible too); call under the table's lock."""
        return [s.kv for s in self._loading.values()]

    async def open(self, prompt: list[int], sampling: SamplingParams, stopping: StoppingCriteria,
                   tenant_id: str = "", num_output_tokens: int = 0, features=None, draft_label: str = "") -> Session:
        """Admit a new session (a fresh id; a random seed when ``sampling.seed`` is None), prefill ``prompt``
        (validated token ids) and create its store record; its last ``num_output_tokens`` ids (validated) are
        output already generated (a re-open after failover): the record's prompt_length leaves them out.
        ``features``: a resolved common.features.FeatureRequest: the prefill keeps the prompt's features (in
        ``session.prefill_hidden``) and takes nothing from the prefix cache (cached pages have none).
        ``draft_label``: the draft version it drafts with ("name@version", "" = not said), kept in its record.

        Raises:
            CapacityError: max_sessions reached or no KV budget left.
            VerifierUnavailableError: shutting down, or the store is unreachable (nothing stays reserved).
        """
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))  # every other field kept
        now = time.time()
        record = SessionRecord(
            session_id=secrets.token_hex(12),
            verifier_id=self.table.info.verifier_id,
            model_id=self.table.info.model_id,
            prompt_length=len(prompt) - num_output_tokens,
            committed_token_ids=list(prompt),
            sampling=sampling,
            stopping=stopping,
            seed=int(sampling.seed),
            created_at=now,
            last_seen_at=now,
            tenant_id=tenant_id,
            draft_label=draft_label,
        )
        session = await self._load(record, features)
        try:
            self.table.store.create(dataclasses.replace(record, committed_token_ids=list(prompt)))
        except BaseException:  # store unreachable: nothing may stay reserved for a session nobody can use
            self.table.release(record.session_id)
            raise
        metrics.SESSIONS_OPENED.inc()
        return session

    async def get_or_resume(self, session_id: str, tenant_id: str | None = None, features=None,
                            features_from: int | None = None) -> Session:
        """The session held here, or resumed from the store (concurrent callers share one resume). A resume
        for a block asking ``features`` (a resolved FeatureRequest) with ``features_from`` (a position) keeps
        the re-prefill's features of positions ``features_from`` .. in ``session.resumed_features``.

        Raises:
            SessionNotFoundError: unknown or expired in the store, or expired while being resumed.
            PreconditionError: the stored session is for another model.
            CapacityError: no room to resume it here.
        """
        session = self.table.held(session_id)
        if session is not None:
            return owned(session, session_id, tenant_id)
        pending = self._resuming.get(session_id)
        if pending is not None:  # another request is already resuming it: share that prefill
            return owned(await asyncio.shield(pending), session_id, tenant_id)
        future = asyncio.get_running_loop().create_future()
        self._resuming[session_id] = future
        try:
            session = await self._resume(session_id, tenant_id,
                                         features if features_from is not None else None, features_from)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved
            raise
        else:
            future.set_result(session)
            return session
        finally:
            del self._resuming[session_id]

    async def _resume(self, session_id: str, tenant_id: str | None = None, features=None,
                      features_from: int | None = None) -> Session:
        record = self.table.store.get(session_id)
        if record is None or (tenant_id is not None and record.tenant_id != tenant_id):  # before any prefill
            raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
        if record.model_id != self.table.info.model_id:
            raise PreconditionError(
                f"session {session_id} is for model {record.model_id}, not {self.table.info.model_id}")
        log.info("resuming session %s from the store (was on %s)", session_id, record.verifier_id)
        record.verifier_id = self.table.info.verifier_id
        session = await self._load(record, features)
        if features is not None:
            keep_resumed_features(session, features_from)
        if not self.table.store.claim(session_id, self.table.info.verifier_id, time.time()):
            self.table.release(session_id)
            raise SessionNotFoundError(f"session {session_id!r} expired while being resumed")
        metrics.SESSIONS_RESUMED.inc()
        return session

    async def _load(self, record: SessionRecord, features=None) -> Session:
        """Admit ``record`` (max_sessions, counting sessions being opened), then prefill it."""
        with self.table.lock:
            if self.table.num_sessions + self._opening >= self.table.max_sessions:
                raise CapacityError(
                    f"verifier full: {self.table.num_sessions} of {self.table.max_sessions} sessions open")
            self._opening += 1
        try:
            return await self._prefill(record, features)
        finally:
            with self.table.lock:
                self._opening -= 1

    async def _prefill(self, record: SessionRecord, features=None) -> Session:
        """Take KV pages for ``record``'s committed tokens except the last, prefill them (in chunks), add the
        session to the table. The last committed token is fed with the first block."""
        capacity = min(self.table.info.max_context_tokens, record.prompt_length + record.stopping.max_new_tokens)
        # the longest cached prefix of the committed tokens is taken, not prefilled (cloud_verifier/kv/prefix_cache.py)
        with self.table.lock:  # page tables change under the table's lock (the batcher preempts under it)
            kv, cached = open_session_kv(self.table.target, capacity, record.committed_token_ids, record.tenant_id,
                                         use_cache=features is None)
        stop = StopChecker(
            self.table.target.tokenizer, record.stopping, self.table.eos_token_ids, record.prompt_length,
            self.table.info.max_context_tokens,
        )
        generated = record.committed_token_ids[record.prompt_length :]
        if generated:
            stop.append(generated)
        session = Session(record=record, kv=kv, stop=stop, busy=True, prefill_features=features)
        if self.table.ledger is not None:  # opened or resumed: counted under the draft version its record names
            session.draft = self.table.ledger.tally_of(record)
        with self.table.lock:
            self._loading[id(session)] = session  # preemptible while it is prefilled
        try:
            prefix = record.committed_token_ids[:-1]
            for begin in range(cached, len(prefix), self.table.prefill_chunk_tokens):
                await self.table.prefill_chunk(session, prefix[begin : begin + self.table.prefill_chunk_tokens], begin)
                # committed tokens: their full pages are final, shared with sessions opening from now on
                with self.table.lock:
                    cache_prefilled(self.table.target, kv, prefix, begin + self.table.prefill_chunk_tokens,
                                    record.tenant_id)
        except BaseException:
            with self.table.lock:
                self._loading.pop(id(session), None)
                self.table.target.free(kv)
            raise
        session.busy = False
        with self.table.lock:
            self._loading.pop(id(session), None)
            self.table.hold(session)
        self.table.update_gauges()
        return session

    # ------------------------------------------------------------------ extend (multi-turn sessions)
    async def extend(self, session: Session, expected_length: int, appended: list[int], sampling: SamplingParams,
                     stopping: StoppingCriteria, features=None) -> Session:
        """Continue a finished (or not started) session with the next turn of its conversation: raise its KV
        limit to ``committed + appended + stopping.max_new_tokens`` tokens (capped by the context) when needed,
        take pages for the new tokens and prefill only them (the last committed token, then ``appended`` but its
        last, in chunks of ``prefill_chunk_tokens``; the KV cache of everything before stays), then commit the
        turn in the store (compare-and-append on ``expected_length``) and reset the stopping state: the new turn's
        output starts at the new committed length. ``appended``: validated token ids; ``sampling`` with its seed.
        ``features`` (a resolved FeatureRequest): the prefill keeps its positions' (``prefill_hidden``), uncached.
        Nothing committed changes on any error (positions the prefill wrote lie past the committed length: their
        pages are dropped when the turn ends).

        Raises:
            ConflictError: ``expected_length`` differs from the session's committed length.
            PreconditionError: the session is generating (finished = False and output committed).
            SessionNotFoundError: the session was closed, or expired in the store.
            CapacityError: no KV budget for the longer session (nothing stays reserved).
            StaleSessionError: another replica took the session meanwhile (stale copy: released here).
            VerifierUnavailableError: shutting down, or the store is unreachable.
        """
        from specdec_runtime.cloud_verifier.store import extend_conflict, generating_error

        record = session.record
        sid = record.session_id
        with self.table.lock:
            if session.released:
                raise SessionNotFoundError(f"session {sid!r} was closed")
            if record.committed_length != expected_length:
                raise extend_conflict(sid, expected_length, record.committed_length)
            if not record.finished and record.committed_length != record.prompt_length:
                raise generating_error(sid)
            if session.busy:
                raise PreconditionError(f"session {sid!r} has a block in flight")
            session.busy, session.prefill_features, session.prefill_hidden = True, features, []  # no block slips in
        try:
            start = record.committed_length - 1  # the KV cache holds committed[:-1]
            new_length = record.committed_length + len(appended)
            needed = min(self.table.info.max_context_tokens, new_length + stopping.max_new_tokens)
            limit = session.kv.capacity
            session.kv.capacity = max(limit, needed)  # a limit: memory comes as pages, no copy
            history = [*record.committed_token_ids, *appended]
            with self.table.lock:  # page tables change under the table's lock (the batcher preempts under it)
                try:
                    self.table.target.check_fits(session.kv.capacity)
                except CapacityError:
                    session.kv.capacity = limit
                    raise
                # pages of this history another session left in the prefix cache are taken, not prefilled
                skip_begin, skip_end = (
                    extend_session_kv(self.table.target, session.kv, history, start, record.tenant_id)
                    if session.kv.rebuild_from is None and features is None else (start, start))
                # best effort: a pool short now leaves it to the batcher (it preempts later sessions if it must)
                self.table.target.try_ensure(session.kv, new_length - 1)
                session.kv.pending_ids = history  # what a recomputation after a preemption reads
            chunk = self.table.prefill_chunk_tokens
            for begin, end in ((start, skip_begin), (skip_end, new_length - 1)):
                for pos in range(begin, end, chunk):
                    await self.table.prefill_chunk(session, history[pos : min(pos + chunk, end)], pos)
            now = time.time()
            self.table.store.extend(sid, expected_length, appended, sampling, stopping, now,
                                    self.table.info.verifier_id)
            record.committed_token_ids.extend(appended)
            record.prompt_length = new_length
            record.sampling, record.stopping, record.seed = sampling, stopping, int(sampling.seed)
            record.finished, record.finish_reason = False, None
            record.last_seen_at = now
            session.stop = StopChecker(self.table.target.tokenizer, stopping, self.table.eos_token_ids, new_length,
                                       self.table.info.max_context_tokens)
            session.kv.pending_ids = None
            # committed now (not before the store's answer: the next block would write after the old length)
            with self.table.lock:
                cache_prefilled(self.table.target, session.kv, record.committed_token_ids, new_length - 1,
                                record.tenant_id)
        except (SessionNotFoundError, StaleSessionError):
            self.table.release(sid)  # gone from the store, or held elsewhere: this copy is stale
            raise
        finally:
            session.kv.pending_ids = None
            self.table.end_busy(session)
        return session
