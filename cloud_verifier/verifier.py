"""The cloud verifier: sessions, block validation, batched verification, stopping, session store.

One :class:`Verifier` serves many edge sessions. Verify requests (draft blocks) and prefill chunks from all
sessions go into one queue; a batcher task takes what is waiting (up to ``max_batch_size`` blocks, waiting at
most ``max_batch_wait_ms`` for more) and runs ONE target forward pass over all of them
(:meth:`cloud_verifier.target.TargetRunner.forward`, ragged: rows of different committed lengths and block
lengths, no padding). Blocks keep arriving while a batch runs and join the next one (continuous batching at
verify-step granularity, as in vLLM / SGLang). Long prompts are prefilled in chunks of
``prefill_chunk_tokens`` interleaved with verify steps, so a new session does not stall running ones for long.

The rejection rule is applied per row with each session's own counter-based random stream
(common.rejection), so a session's output does not depend on which sessions share its batches.

Session metadata lives in a :class:`cloud_verifier.store.SessionStore` (Redis in production): committed token
ids, sampling parameters, seed, owner replica. A session unknown to this replica but present in the store (its
replica crashed or drained) is resumed here by re-prefilling its committed tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cloud_verifier import metrics
from cloud_verifier.store import SessionRecord, SessionStore, MemorySessionStore
from cloud_verifier.target import ForwardRow, SessionKV, TargetRunner
from common.errors import (
    CapacityError,
    InvalidRequestError,
    PreconditionError,
    SessionNotFoundError,
    SpecdecError,
    VerifierUnavailableError,
)
from common.rejection import verify_greedy, verify_sampled
from common.sampling import logits_to_probs, normalize_sparse
from common.stopping import StopChecker
from common.types import DraftBlock, SamplingParams, ServedInfo, SessionOpened, StoppingCriteria, Verdict
from common.vocab import tokenizer_fingerprint

log = logging.getLogger(__name__)

PROB_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed for a sparse draft distribution on the wire


@dataclass
class _Session:
    record: SessionRecord
    kv: SessionKV
    stop: StopChecker
    busy: bool = False  # a block of this session is queued or running
    released: bool = False  # closed/expired: KV freed, or to be freed when the block in flight is done
    last_seen: float = field(default_factory=time.time)

    @property
    def committed(self) -> list[int]:
        return self.record.committed_token_ids


@dataclass
class _Work:
    """One queued unit: a verify step (block is not None) or a prefill chunk."""

    session: _Session
    tokens: list[int]
    start_position: int
    future: asyncio.Future
    block: DraftBlock | None = None
    seq: int = 0
    enqueued: float = field(default_factory=time.perf_counter)


class Verifier:
    """Batched lossless verifier over a :class:`TargetRunner`.

    Args:
        target: the target runner.
        store: session metadata store (MemorySessionStore when None).
        verifier_id, model_id: names reported to clients and written to the store.
        max_num_speculative_tokens: largest draft block accepted, tokens.
        max_sessions: open sessions allowed on this replica.
        max_batch_size: most verify blocks in one forward pass.
        max_batch_wait_ms: longest wait for more blocks once one is waiting, ms.
        prefill_chunk_tokens: prompt tokens prefilled per forward pass.
        session_ttl_s: idle time after which a session is freed, s.
        reap_interval_s: how often idle sessions are looked for, s.
    """

    def __init__(
        self,
        target: TargetRunner,
        store: SessionStore | None = None,
        *,
        verifier_id: str = "verifier-0",
        model_id: str | None = None,
        max_num_speculative_tokens: int = 16,
        max_sessions: int = 256,
        max_batch_size: int = 32,
        max_batch_wait_ms: float = 2.0,
        prefill_chunk_tokens: int = 256,
        session_ttl_s: int = 600,
        reap_interval_s: float = 5.0,
    ):
        self.target = target
        self.store = store if store is not None else MemorySessionStore(ttl_s=session_ttl_s)
        self.max_sessions = max_sessions
        self.max_batch_size = max_batch_size
        self.max_batch_wait_s = max_batch_wait_ms / 1000.0
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.session_ttl_s = session_ttl_s
        self.reap_interval_s = reap_interval_s
        tok = target.tokenizer
        self.valid_vocab_size = min(len(tok), target.vocab_size) if tok is not None else target.vocab_size
        eos = getattr(target.model.generation_config, "eos_token_id", None) or getattr(tok, "eos_token_id", None)
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self.info = ServedInfo(
            model_id=model_id or Path(target.model_dir).name,
            tokenizer_fingerprint=tokenizer_fingerprint(tok) if tok is not None else "",
            max_context_tokens=target.max_context_tokens,
            max_num_speculative_tokens=max_num_speculative_tokens,
            vocab_size=target.vocab_size,
            verifier_id=verifier_id,
            ttl_s=int(session_ttl_s),
        )
        self._sessions: dict[str, _Session] = {}
        self._resuming: dict[str, asyncio.Future] = {}  # session id -> resume in progress
        self._opening = 0  # sessions being prefilled (count towards max_sessions)
        self._sessions_lock = threading.Lock()
        self._queue: asyncio.Queue[_Work] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-target")
        self._tasks: list[asyncio.Task] = []
        self._inflight = 0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        metrics.KV_CACHE_CAPACITY_BYTES.set(target.kv_cache_budget_tokens * target.kv_bytes_per_token)

    @classmethod
    def from_settings(cls, settings) -> "Verifier":
        """Build from :class:`cloud_verifier.config.VerifierSettings` (loads the target, makes the store)."""
        from cloud_verifier.store import make_store
        from common.paths import default_model_paths

        target_dir = settings.target or default_model_paths().target_dir
        runner = TargetRunner(
            target_dir,
            kv_cache_budget_tokens=settings.kv_cache_budget_tokens,
            device=getattr(settings, "device", "cpu"),
            num_threads=settings.torch_threads,
        )
        return cls(
            runner,
            make_store(settings),
            verifier_id=settings.verifier_id,
            model_id=settings.model_id,
            max_num_speculative_tokens=settings.max_num_speculative_tokens,
            max_sessions=settings.max_sessions,
            max_batch_size=settings.max_batch_size,
            max_batch_wait_ms=settings.max_batch_wait_ms,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            session_ttl_s=settings.session_ttl_s,
            reap_interval_s=settings.reap_interval_s,
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the batcher and the idle-session reaper on the running event loop."""
        if self._queue is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._stopping = False
        self._tasks = [asyncio.create_task(self._batch_loop()), asyncio.create_task(self._reap_loop())]

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new work, let queued and running blocks finish (up to ``grace_s`` s), then stop."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._queue is not None and (self._inflight or not self._queue.empty()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._queue = None

    def shutdown(self) -> None:
        """Free every session's KV cache (their store records stay, so another replica can resume them)."""
        with self._sessions_lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            self.target.free(s.kv)
        self._update_gauges()
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ sessions
    async def open_session(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        tokenizer_fingerprint: str = "",
    ) -> SessionOpened:
        """Validate, reserve a KV cache, prefill the prompt (chunked, interleaved with verify steps), record.

        Raises:
            InvalidRequestError: empty prompt, token id out of range, prompt fills the context, bad params.
            PreconditionError: tokenizer fingerprint differs from the target's.
            CapacityError: max_sessions reached or no KV budget left.
            VerifierUnavailableError: shutting down.
        """
        self._check_running()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequestError("empty prompt: at least one token id is needed")
        self._check_ids(prompt, "prompt")
        try:
            sampling.validate()
            stopping.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if tokenizer_fingerprint and self.info.tokenizer_fingerprint and (
            tokenizer_fingerprint != self.info.tokenizer_fingerprint
        ):
            raise PreconditionError(
                f"tokenizer fingerprint {tokenizer_fingerprint} does not match the target's "
                f"{self.info.tokenizer_fingerprint} ({self.info.model_id}): draft and target must share a vocabulary"
            )
        max_ctx = self.info.max_context_tokens
        if len(prompt) >= max_ctx:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens leaves no room in the context of {max_ctx} tokens"
            )
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
        )
        session = await self._load_session(record, new=True)
        try:
            self.store.create(dataclasses.replace(record, committed_token_ids=list(prompt)))
        except BaseException:  # store unreachable: nothing may stay reserved for a session nobody can use
            self._release(record.session_id)
            raise
        metrics.SESSIONS_OPENED.inc()
        return self._opened(session)

    def _opened(self, session: _Session) -> SessionOpened:
        r = session.record
        return SessionOpened.of(self.info, r.session_id, r.committed_length, r.seed)

    async def _load_session(self, record: SessionRecord, new: bool) -> _Session:
        """Reserve the KV cache and prefill ``record``'s committed tokens except the last."""
        with self._sessions_lock:
            if len(self._sessions) + self._opening >= self.max_sessions:
                raise CapacityError(f"verifier full: {len(self._sessions)} of {self.max_sessions} sessions open")
            self._opening += 1
        try:
            return await self._prefill_new(record)
        finally:
            with self._sessions_lock:
                self._opening -= 1

    async def _prefill_new(self, record: SessionRecord) -> _Session:
        capacity = min(
            self.info.max_context_tokens, record.prompt_length + record.stopping.max_new_tokens
        )
        kv = self.target.allocate(capacity)
        stop = StopChecker(
            self.target.tokenizer, record.stopping, self.eos_token_ids, record.prompt_length,
            self.info.max_context_tokens,
        )
        generated = record.committed_token_ids[record.prompt_length :]
        if generated:
            stop.append(generated)
        session = _Session(record=record, kv=kv, stop=stop, busy=True)
        try:
            prefix = record.committed_token_ids[:-1]
            for begin in range(0, len(prefix), self.prefill_chunk_tokens):
                chunk = prefix[begin : begin + self.prefill_chunk_tokens]
                await self._submit(_Work(session, chunk, begin, self._new_future()))
        except BaseException:
            self.target.free(kv)
            raise
        session.busy = False
        with self._sessions_lock:
            self._sessions[record.session_id] = session
        self._update_gauges()
        return session

    async def _get_or_resume(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        pending = self._resuming.get(session_id)
        if pending is not None:  # another request is already resuming it: share that prefill
            return await asyncio.shield(pending)
        future = asyncio.get_running_loop().create_future()
        self._resuming[session_id] = future
        try:
            session = await self._resume(session_id)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved
            raise
        else:
            future.set_result(session)
            return session
        finally:
            del self._resuming[session_id]

    async def _resume(self, session_id: str) -> _Session:
        record = self.store.get(session_id)
        if record is None:
            raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
        if record.model_id != self.info.model_id:
            raise PreconditionError(f"session {session_id} is for model {record.model_id}, not {self.info.model_id}")
        log.info("resuming session %s from the store (was on %s)", session_id, record.verifier_id)
        record.verifier_id = self.info.verifier_id
        session = await self._load_session(record, new=False)
        if not self.store.claim(session_id, self.info.verifier_id, time.time()):
            self._drop_local(session_id)
            raise SessionNotFoundError(f"session {session_id!r} expired while being resumed")
        metrics.SESSIONS_RESUMED.inc()
        return session

    def _drop_local(self, session_id: str) -> None:
        """Forget this replica's copy of a session (its KV cache); the store record is untouched."""
        self._release(session_id)

    def get_session(self, session_id: str) -> SessionRecord:
        """The session's record (from the store: the source of truth for committed tokens).

        Raises:
            SessionNotFoundError: unknown, closed or expired.
        """
        record = self.store.get(session_id)
        if record is None:
            raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
        return record

    def _release(self, session_id: str) -> _Session | None:
        """Remove a session from this replica and free its KV cache — at once, or, when one of its blocks is
        queued or in a forward pass, as soon as that block is done (never under a running batch)."""
        with self._sessions_lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return None
            session.released = True
            if not session.busy:
                self.target.free(session.kv)
        self._update_gauges()
        return session

    def close_session(self, session_id: str) -> bool:
        """Free the session's KV cache and delete its store keys; False if it did not exist."""
        session = self._release(session_id)
        if session is not None:
            metrics.SESSIONS_CLOSED.inc()
        existed = self.store.delete(session_id)
        return existed or session is not None

    def reap_expired(self, now: float | None = None) -> int:
        """Free sessions idle for longer than the TTL (and those whose store record expired). Returns the count."""
        now = time.time() if now is None else now
        with self._sessions_lock:
            candidates = [s for s in self._sessions.values() if not s.busy]
        reaped = 0
        for s in candidates:
            sid = s.record.session_id
            if now - s.last_seen > self.session_ttl_s or self.store.get(sid) is None:
                gone = self._release(sid)
                if gone is not None:
                    self.store.delete(sid, verifier_id=self.info.verifier_id)
                    metrics.SESSIONS_EXPIRED.inc()
                    reaped += 1
        if reaped:
            self._update_gauges()
        return reaped

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ verify
    async def verify(self, session_id: str, seq: int, committed_length: int, block: DraftBlock) -> Verdict:
        """Verify one draft block of a session (batched with other sessions' blocks).

        Raises:
            SessionNotFoundError: unknown or expired session.
            InvalidRequestError: malformed block (nothing committed changes).
            PreconditionError: the session already finished.
            VerifierUnavailableError: shutting down.
        """
        self._check_running()
        session = await self._get_or_resume(session_id)
        with self._sessions_lock:
            self._validate_block(session, seq, committed_length, block)
            if session.released:
                raise SessionNotFoundError(f"session {session_id!r} was closed")
            session.busy = True
        try:
            last = session.committed[-1]
            work = _Work(session, [last, *block.draft_token_ids], committed_length - 1, self._new_future(),
                         block=block, seq=seq)
            return await self._submit(work)
        finally:
            with self._sessions_lock:
                session.busy = False
                session.last_seen = time.time()
                if session.released:  # closed while its block was in flight: free it now
                    self.target.free(session.kv)
            if session.released:
                self._update_gauges()

    def _validate_block(self, session: _Session, seq: int, committed_length: int, block: DraftBlock) -> None:
        r = session.record
        sid = r.session_id
        if r.finished or session.stop.finished:
            raise PreconditionError(f"session {sid} already finished ({(r.finish_reason or session.stop.finish_reason).value})")
        if session.busy:
            raise InvalidRequestError(f"session {sid} already has a block in flight")
        if committed_length != r.committed_length:
            raise InvalidRequestError(
                f"block extends committed length {committed_length}, but session {sid} has {r.committed_length}"
            )
        if seq <= r.last_seq:
            raise InvalidRequestError(f"block seq {seq} is not after the last seq {r.last_seq}")
        gamma = len(block.draft_token_ids)
        if gamma > self.info.max_num_speculative_tokens:
            raise InvalidRequestError(f"block of {gamma} tokens is longer than the maximum {self.info.max_num_speculative_tokens}")
        if committed_length + gamma > session.kv.capacity:
            raise InvalidRequestError(
                f"block of {gamma} tokens at committed length {committed_length} passes the session's limit of "
                f"{session.kv.capacity} tokens (max_new_tokens / context)"
            )
        self._check_ids(block.draft_token_ids, "draft")
        dp = block.draft_probs
        if dp is not None:
            ids, probs = np.asarray(dp.token_ids), np.asarray(dp.probs, dtype=np.float64)
            if ids.shape != probs.shape or ids.ndim != 2 or ids.shape[0] != gamma:
                raise InvalidRequestError(
                    f"draft_probs must have one sparse distribution per draft token ({gamma}), got shape {ids.shape}"
                )
            if ids.size and (ids.min() < 0 or ids.max() >= self.info.vocab_size):
                raise InvalidRequestError("draft_probs token id outside the vocabulary")
            if not np.all(np.isfinite(probs)) or (probs < 0).any():
                raise InvalidRequestError("draft_probs are not a distribution: negative or non-finite values")
            sums = probs.sum(axis=-1)
            if np.any(np.abs(sums - 1.0) > PROB_SUM_TOLERANCE):
                raise InvalidRequestError(f"draft_probs are not a distribution: rows sum to {sums.round(4).tolist()}")
            for i, x in enumerate(block.draft_token_ids):
                row = ids[i]
                if len(np.unique(row)) != len(row):
                    raise InvalidRequestError(f"draft_probs row {i} repeats a token id")
                q_x = normalize_sparse(probs[i])[row == x]
                if q_x.size == 0 or not q_x[0] > 0:
                    raise InvalidRequestError(f"draft token {x} at block position {i} has draft probability 0")

    def _check_ids(self, ids: list[int], what: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.valid_vocab_size):
            bad = next(t for t in ids if t < 0 or t >= self.valid_vocab_size)
            raise InvalidRequestError(f"{what} token id {bad} is outside the vocabulary [0, {self.valid_vocab_size})")

    def _check_running(self) -> None:
        if self._queue is None or self._stopping:
            raise VerifierUnavailableError("verifier is not running (shutting down or not started)")

    # ------------------------------------------------------------------ batching
    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    async def _submit(self, work: _Work):
        if self._queue is None:
            raise VerifierUnavailableError("verifier is not running")
        self._inflight += 1
        try:
            self._queue.put_nowait(work)
            return await work.future
        finally:
            self._inflight -= 1

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            first = await queue.get()
            batch = [first]
            deadline = loop.time() + self.max_batch_wait_s
            while len(batch) < self.max_batch_size:
                if sum(1 for w in batch if w.block is not None) >= len(self._sessions) > 0:
                    break  # every open session already has its block here: nothing else can come
                if queue.empty():
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(queue.get(), timeout))
                    except asyncio.TimeoutError:
                        break
                else:
                    batch.append(queue.get_nowait())
            # at most one prefill chunk per forward pass: the others wait for the next one (interleaving)
            prefills = [w for w in batch if w.block is None]
            for w in prefills[1:]:
                queue.put_nowait(w)
            batch = [w for w in batch if w.block is not None] + prefills[:1]
            batch = [w for w in batch if not w.future.done()]  # requests cancelled while queued
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, batch)
            except Exception as e:  # a bug: fail this batch's requests, keep serving
                log.exception("batch failed")
                results = [e] * len(batch)
            for work, result in zip(batch, results):
                if work.future.done():
                    continue
                if isinstance(result, BaseException):
                    work.future.set_exception(result)
                else:
                    work.future.set_result(result)

    def _run_batch(self, batch: list[_Work]) -> list:
        """Runs in the target thread: one forward pass, then the rejection rule per verify row."""
        start = time.perf_counter()
        rows = [ForwardRow(w.session.kv, w.tokens, w.start_position, "all" if w.block is not None else "none") for w in batch]
        logits = self.target.forward(rows)
        forward_ms = (time.perf_counter() - start) * 1000
        num_blocks = sum(1 for w in batch if w.block is not None)
        metrics.observe_forward(forward_ms / 1000, num_blocks, sum(len(w.tokens) for w in batch))
        results = []
        for work, row_logits in zip(batch, logits):
            if work.block is None:
                results.append(None)
                continue
            try:
                queue_ms = (start - work.enqueued) * 1000
                results.append(self._apply_verdict(work, row_logits, queue_ms, forward_ms, num_blocks))
            except SpecdecError as e:
                results.append(e)
            except Exception as e:
                log.exception("verify failed")
                results.append(e)
        return results

    def _apply_verdict(self, work: _Work, logits: np.ndarray, queue_ms: float, forward_ms: float, batch_size: int) -> Verdict:
        session, block = work.session, work.block
        record = session.record
        sampling = record.sampling
        committed_length = record.committed_length
        if sampling.greedy:
            result = verify_greedy(block.draft_token_ids, logits, self.valid_vocab_size)
        else:
            target_probs = logits_to_probs(logits, sampling, self.valid_vocab_size)  # [γ + 1, vocab_size]
            result = verify_sampled(
                block.draft_token_ids, block.draft_probs, target_probs, record.seed, committed_length
            )
        n = result.num_accepted
        candidates = [*block.draft_token_ids[:n], result.next_token_id]
        num_committed, reason = session.stop.append(candidates)
        committed = candidates[:num_committed]
        finished = reason is not None
        try:
            new_length = self.store.append_committed(
                record.session_id, committed_length, committed, work.seq, finished, reason, time.time()
            )
        except (InvalidRequestError, SessionNotFoundError, PreconditionError):
            # the store moved on without us (another replica committed, or the session expired/finished):
            # our copy is stale; drop it so the next block resumes from the store
            self._drop_local(record.session_id)
            raise
        record.committed_token_ids.extend(committed)
        record.last_seq = work.seq
        record.finished, record.finish_reason = finished, reason
        assert new_length == record.committed_length
        num_accepted = min(n, num_committed)
        metrics.observe_verdict(len(block.draft_token_ids), num_accepted, queue_ms / 1000)
        return Verdict(
            num_accepted=num_accepted,
            next_token_id=result.next_token_id if num_committed > n else -1,
            is_bonus=num_committed > n and n == len(block.draft_token_ids) and len(block.draft_token_ids) > 0,
            committed_token_ids=committed,
            committed_length=record.committed_length,
            finished=finished,
            finish_reason=reason,
            queue_ms=queue_ms,
            forward_ms=forward_ms,
            batch_size=batch_size,
            seq=work.seq,
        )

    # ------------------------------------------------------------------ housekeeping
    async def _reap_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await loop.run_in_executor(None, self.reap_expired)
            except SpecdecError as e:  # e.g. the store is unreachable: one line, retried next period
                log.warning("reaper: %s", e)
            except Exception:
                log.exception("reaper failed")

    def _update_gauges(self) -> None:
        metrics.SESSIONS_OPEN.set(len(self._sessions))
        metrics.KV_CACHE_USED_BYTES.set(self.target.kv_reserved_bytes)
