"""The batched verify step: draft blocks of many sessions, ONE target forward pass, one verdict per block.

Speculative decoding (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1): the target scores a draft block of γ tokens x_1..x_γ in one forward pass over
[last committed token, x_1, ..., x_γ], which gives its distributions p_1..p_{γ+1} at once; the rejection rule
keeps the longest prefix it accepts and adds one token of the target's own (recovered after a rejection, bonus
after a full block), so the output is distributed exactly as the target's alone. A bonus_drafted block (see
:mod:`common.rejection`) is scored over ``block.num_scored_positions`` rows.

The verifier batches that step across sessions: continuous batching at verify-step granularity, as in vLLM
(and SGLang). Blocks keep arriving while a batch runs and join the next one. One step, as this file runs it:

1. **Queue**: each verify request (a block) and each prefill chunk is a :class:`Work` item on one queue.
2. **Collect**: the batch loop takes the first waiting item, then more, up to ``max_batch_size`` items,
   waiting at most ``max_batch_wait_ms`` for them (it stops early once every open session has its block
   in), and up to ``straggler_wait_fraction`` of the last forward pass for the sessions answered last step that
   have not sent their next block yet (a session that misses a step waits a whole forward pass; on a CPU, 256
   clients answering one 6 s step need ~100 ms to send theirs back). At most one chunk's worth of prefill tokens
   per forward pass (one chunk, or several short prompts' chunks that fit in ``prefill_chunk_tokens``): a long
   prompt is prefilled interleaved with the running sessions' verify steps instead of stalling them.
3. **Verify lengths**: the verify policy picks, per verify row, the prefix of its block this step verifies
   (:mod:`cloud_verifier.verify_policy`: every position, or adaptive). Then **KV pages**: every row's pages,
   earliest admitted session first; when the paged pool is short, sessions admitted later are preempted (their
   pages dropped, their KV recomputed at their next row) and a row that still finds none waits for the next step
   (:mod:`cloud_verifier.kv.scheduler`).
4. **Forward**: ONE ragged target forward pass over all rows (:meth:`~cloud_verifier.target.runner.TargetRunner.forward`).
5. **Verdict**, every verify row of the pass at once: the rejection rule (:func:`cloud_verifier.verdict.rejections`:
   the per-session logits processors, the guards on bad logits, then one batched rejection sampler over all rows;
   greedy at temperature 0, speculative sampling otherwise, each session with its own counter-based random
   stream, so its output does not depend on which sessions share its batches; :func:`common.rejection.verify_block`
   is the per-row reference it is tested against); then per row, stopping over the candidate tokens (EOS, stop
   strings, length, context: nothing after the earliest stop is committed) and the commit to the store, a
   compare-and-append on the committed length (a stale replica cannot commit: its copy is dropped, the next block
   resumes from the store).

Sessions and the deferred KV release: :mod:`cloud_verifier.session.table`; block validation:
:mod:`cloud_verifier.session.validation`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.kv.scheduler import KVScheduler
from specdec_runtime.cloud_verifier.session.state import Session
from specdec_runtime.cloud_verifier.session.table import SessionTable
from specdec_runtime.cloud_verifier.store import SessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verdict import committed_logprobs, make_verdict, rejections
from specdec_runtime.cloud_verifier.verify_policy import VerifyPolicy, set_verify_lengths
from specdec_runtime.cloud_verifier.work import Work
from specdec_runtime.common.errors import (InvalidRequestError, PreconditionError, SessionNotFoundError, SpecdecError,
                           StaleSessionError, VerifierUnavailableError)
from specdec_runtime.common.rejection import RejectionResult
from specdec_runtime.common.types import DraftBlock, Verdict

log = logging.getLogger(__name__)

_DEFERRED = object()  # a step's result for an item that got no KV pages (it waits for the next step)
_DEFERRED_WAIT_S = 0.01  # after a step that ran nothing, the longest wait for a new item before retrying, s


class Batcher:
    """The queue, the batch loop and the verdict.

    Args:
        target: the target runner (its forward passes run on one dedicated thread).
        store: the session store (compare-and-append commits).
        sessions: the session table (open-session count; stale copies are released there).
        valid_vocab_size: token ids at or past it are logit padding, never chosen.
        max_batch_size: most queued items (verify blocks + prefill chunks) taken per forward pass.
        max_batch_wait_ms: longest wait for more items once one is waiting, ms.
        straggler_wait_fraction: longest wait, as a fraction of the last forward pass, for the next blocks of
            the sessions that the last step answered and did not finish (0: wait only ``max_batch_wait_ms``).
            It costs the rows already collected at most that fraction of a step; a straggler it catches saves a
            whole step.
        heartbeat_interval_s: the batch loop beats :attr:`heartbeat` at least this often while idle, s.
        verify_policy: how much of each block a step verifies (:mod:`cloud_verifier.verify_policy`; default
            :class:`~cloud_verifier.verify_policy.VerifyPolicy`, every position); each step refines its cost model.

    Cancellation: a verify or prefill request cancelled while its item is queued is dropped (nothing of it is
    committed); one cancelled once its item is in a forward pass waits for that pass and its commit to end
    (the block is committed wholly), then raises CancelledError. Either way the session is free again when the
    cancelled call returns.
    """

    def __init__(
        self,
        target: TargetRunner,
        store: SessionStore,
        sessions: SessionTable,
        *,
        valid_vocab_size: int,
        max_batch_size: int,
        max_batch_wait_ms: float,
        straggler_wait_fraction: float = 0.05,
        heartbeat_interval_s: float = 1.0,
        verify_policy: VerifyPolicy | None = None,
    ):
        self.target = target
        self.store = store
        self.sessions = sessions
        self.valid_vocab_size = valid_vocab_size
        self.max_batch_size = max_batch_size  # read before each batch (may be changed between batches)
        self.max_batch_wait_s = max_batch_wait_ms / 1000.0
        self.straggler_wait_fraction = straggler_wait_fraction
        self._returning: set[int] = set()  # id() of sessions the last step answered and did not finish
        self._prev_forward_s = 0.0  # the last step's forward pass, s
        self._queue: asyncio.Queue[Work] | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-target")
        self._inflight = 0  # items submitted and not yet answered
        self._idle_since = time.monotonic()  # when _inflight last fell to 0, monotonic s
        self._stopping = False
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat = time.monotonic()  # monotonic time, s, of the batch loop's last beat (health: stuck loop)
        self._step_started = 0.0  # perf_counter time, s, the current step's first item was taken
        self._step_ended = 0.0  # perf_counter time, s, the last timed step's futures were resolved
        self._last_forward_s: float | None = None  # the current step's forward pass, s (None: it raised)
        self.kv = KVScheduler(target, sessions)  # pages for each forward pass, preempting when the pool is short
        self._deferred: list[Work] = []  # items handed back for want of KV pages: first in the next batch
        self._ran = True  # the last step ran a forward pass (else the next one waits a little for blocks)
        self.verify_policy = verify_policy if verify_policy is not None else VerifyPolicy()
        self._steps = 0  # steps answered (the verify policy's gauges are exported every 16)

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        """Started and not stopping: new work is accepted."""
        return self._queue is not None and not self._stopping

    def heartbeat_age_s(self) -> float:
        """Seconds since the batch loop last beat (it beats before each batch, and at least every
        ``heartbeat_interval_s`` while idle); grows while a forward pass runs or when the loop is stuck or dead."""
        if self._task is not None and self._task.done():
            return float("inf")  # the loop ended (crashed or cancelled)
        return time.monotonic() - self.heartbeat

    def run_on_target(self, fn, *args, **kwargs) -> asyncio.Future:
        """``fn(*args, **kwargs)`` on the target thread between two batch steps (a profile pass), from the loop."""
        return asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def busy(self) -> bool:
        """Work submitted and not answered yet (queued, waiting for KV pages or in a forward pass)."""
        return self._inflight > 0

    def idle_s(self) -> float:
        """Seconds since the batcher last had work (0.0 while it has some)."""
        return 0.0 if self._inflight else time.monotonic() - self._idle_since

    def start(self) -> None:
        """Start the batch loop on the running event loop (no-op when already started)."""
        if self._queue is not None:
            return
        self._queue = asyncio.Queue()
        self._stopping = False
        self._task = asyncio.create_task(self._batch_loop())

    async def stop(self, grace_s: float) -> None:
        """Refuse new work, let queued and running items finish (up to ``grace_s`` s), then stop the loop."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._queue is not None and (self._inflight or not self._queue.empty()) and time.monotonic() <= deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._queue = None

    def close(self) -> None:
        """Release the target thread (the batcher cannot run again)."""
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ entry points
    async def prefill(self, session: Session, tokens: list[int], start_position: int) -> None:
        """Prefill ``tokens`` into the session's KV cache from ``start_position`` (one chunk, one forward pass).

        Raises:
            VerifierUnavailableError: not running.
        """
        await self._submit(Work(session, tokens, start_position, asyncio.get_running_loop().create_future()))

    async def verify(self, session: Session, seq: int, committed_length: int, block: DraftBlock) -> Verdict:
        """Verify a validated block extending ``committed_length`` tokens; its verdict, once committed.

        Raises:
            VerifierUnavailableError: not running.
            InvalidRequestError, SessionNotFoundError, PreconditionError: the store refused the commit (another
                replica committed first, the session expired or finished); this replica's copy is released.
        """
        tokens = [session.committed[-1], *block.scored_draft_token_ids]  # block.num_scored_positions rows
        future = asyncio.get_running_loop().create_future()
        work = Work(session, tokens, committed_length - 1, future, block=block, seq=seq, full_block=block)
        return await self._submit(work)

    async def _submit(self, work: Work):
        if self._queue is None:
            raise VerifierUnavailableError("verifier is not running")
        self._inflight += 1
        try:
            self._queue.put_nowait(work)
            try:
                return await asyncio.shield(work.future)
            except asyncio.CancelledError:
                if not work.started:  # still queued: dropped by the batch loop, nothing of it runs
                    work.future.cancel()
                    raise
                # in a forward pass: its commit happens anyway; return only once it has (no half state)
                try:
                    await asyncio.shield(work.future)
                except BaseException:  # noqa: BLE001 - the caller is cancelled: its result is not wanted
                    pass
                raise
        finally:
            self._inflight -= 1
            self._idle_since = self._idle_since if self._inflight else time.monotonic()

    # ------------------------------------------------------------------ 2. collect, 3. forward
    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            self.heartbeat = time.monotonic()
            batch = await self._collect(queue, loop)
            if not batch:
                continue
            collected = time.perf_counter()
            self._last_forward_s = None
            for work in batch:  # no suspension point since _collect dropped the cancelled items
                work.started = True
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, batch)
            except Exception as e:  # a bug: fail this batch's requests, keep serving
                log.exception("batch failed")
                results = [e] * len(batch)
            if self._ran:
                self.kv.last_run = time.monotonic()  # rows ran: pages come back as they end
            for work, result in zip(batch, results):
                if work.future.done():
                    continue
                if result is _DEFERRED:  # no KV pages this step: offered again next step (cancellable meanwhile)
                    work.started = False
                    work.deferred_since = work.deferred_since or time.monotonic()
                    result = self.kv.give_up(work, work.deferred_since)
                    if result is None:
                        self._deferred.append(work)
                        continue
                if isinstance(result, BaseException):
                    work.future.set_exception(result)
                else:
                    work.future.set_result(result)
            self._note_returning(batch, results)
            self._observe_step(collected)

    def _note_returning(self, batch: list[Work], results: list) -> None:
        """The sessions whose block this step answered without finishing them: their next block is expected."""
        self._returning = {id(w.session) for w, r in zip(batch, results)
                           if w.block is not None and isinstance(r, Verdict) and not r.finished}
        self._prev_forward_s = self._last_forward_s or 0.0

    def _observe_step(self, collected: float) -> None:
        """Time the step just answered: from its first item taken off the queue to its futures resolved
        (collecting, rows, forward, verdicts, stopping, commits), and its host part, step - forward pass (the
        time an accelerator would sit idle). A batch whose forward pass raised is not counted."""
        if self._last_forward_s is None:
            return
        end = time.perf_counter()
        metrics.observe_step(end - self._step_started, self._last_forward_s, collected - self._step_started)
        # the verify policy's host cost (step - forward - collect) and wait for blocks since the last step ended
        wait = collected - (self._step_ended or self._step_started)
        self.verify_policy.observe_host(max(0.0, end - collected - self._last_forward_s), wait)
        self._step_ended = end
        self._steps += 1
        if self._steps % 16 == 1:  # the cost model and calibration gauges (a report per step is not needed)
            metrics.export_verify_policy(self.verify_policy.report())

    async def _collect(self, queue: asyncio.Queue[Work], loop: asyncio.AbstractEventLoop) -> list[Work]:
        """The next batch: up to ``max_batch_size`` items, waiting at most ``max_batch_wait_s`` for more after
        the first; verify rows first, then prefill chunks up to ``prefill_chunk_tokens`` tokens in all (at least
        one chunk; the others go back to the queue). Empty when nothing arrived within ``heartbeat_interval_s``."""
        batch = [w for w in self._deferred if not w.future.done()]  # handed back last step: first now
        self._deferred = []
        try:
            if not batch:
                batch = [await asyncio.wait_for(queue.get(), self.heartbeat_interval_s)]
            elif not self._ran:  # nothing ran last step: pages come back as other sessions' rows end
                batch.append(await asyncio.wait_for(queue.get(), _DEFERRED_WAIT_S))
        except asyncio.TimeoutError:
            if not batch:
                return []
        self._step_started = time.perf_counter()  # the step starts here: idle time before it is not the step's
        now = loop.time()
        deadline = now + self.max_batch_wait_s
        stragglers_deadline = now + self.straggler_wait_fraction * self._prev_forward_s
        expected = self._returning - {id(w.session) for w in batch}
        while len(batch) < self.max_batch_size:
            if sum(1 for w in batch if w.block is not None) >= self.sessions.num_sessions > 0:
                break  # every open session already has its block here: nothing else can come
            if queue.empty():
                timeout = (max(deadline, stragglers_deadline) if expected else deadline) - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            else:
                batch.append(queue.get_nowait())
            expected.discard(id(batch[-1].session))
        # prefill: at most one chunk's worth of tokens per pass (one chunk, or short prompts' chunks that fit
        # together; one at a time, 64 sessions opening together took 64 passes), earliest admitted first (the KV
        # scheduler's order: a session waiting for pages does not hold the budget against those admitted before)
        prefills, budget = [], self.sessions.prefill_chunk_tokens
        for w in sorted(batch, key=lambda w: w.session.kv.order):
            if w.block is None:
                if not prefills or len(w.tokens) <= budget:
                    prefills.append(w)
                    budget -= len(w.tokens)
                else:
                    queue.put_nowait(w)
        batch = [w for w in batch if w.block is not None] + prefills
        return [w for w in batch if not w.future.done()]  # requests cancelled while queued

    def _run_batch(self, batch: list[Work]) -> list:
        """Runs in the target thread: one forward pass, the verdicts of all its verify rows, then per verify row
        stopping and the commit.

        Returns one result per item: a Verdict (verify), None (prefill), the exception to raise, or _DEFERRED
        (no KV pages for it this step: :meth:`cloud_verifier.kv.scheduler.KVScheduler.plan`)."""
        start = time.perf_counter()
        set_verify_lengths(self.verify_policy, batch)  # the part of each block this step verifies
        planned = self.kv.plan(batch)  # pages for every row (preempting later sessions), or the item deferred
        self._ran = bool(planned.runnable)
        if not planned.runnable:
            return [_DEFERRED] * len(batch)
        forward_start = time.perf_counter()  # the plan is host work, not the forward pass
        try:
            run_logits = self.target.forward(planned.rows)  # per verify row: [len(tokens), vocab_size] float32
        except BaseException:
            self.kv.undo(planned)
            raise
        self.kv.after_forward(planned)
        by_work = {id(w): x for w, x in zip(planned.runnable, run_logits)}
        logits = [by_work.get(id(w), _DEFERRED) for w in batch]
        forward_ms = (time.perf_counter() - forward_start) * 1000
        self._last_forward_s = forward_ms / 1000  # read by the batch loop once this step is answered
        num_blocks = sum(1 for w in planned.runnable if w.block is not None)
        num_tokens = sum(len(r.token_ids) for r in planned.rows)
        metrics.observe_forward(forward_ms / 1000, num_blocks, num_tokens)
        self.verify_policy.observe_step(len(planned.rows), num_tokens, forward_ms / 1000)
        verify = [i for i, w in enumerate(batch) if w.block is not None and logits[i] is not _DEFERRED]
        outcomes = self._rejections([batch[i] for i in verify], [logits[i] for i in verify])
        results: list = [_DEFERRED if x is _DEFERRED else None for x in logits]
        for i, outcome in zip(verify, outcomes):
            work = batch[i]
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                queue_ms = (start - work.enqueued) * 1000
                results[i] = self._apply_verdict(work, outcome, queue_ms, forward_ms, num_blocks)
            except SpecdecError as e:
                results[i] = e
            except Exception as e:
                log.exception("verify failed")
                results[i] = e
        return results

    def _rejections(self, works: list[Work], logits: list) -> list:
        """The rejection rule of every verify row of one forward pass (:func:`cloud_verifier.verdict.stage.rejections`);
        per row a RejectionResult or the exception that row raised."""
        return rejections(works, logits, self.valid_vocab_size, self.sessions)

    # ------------------------------------------------------------------ 4. the verdict
    def _apply_verdict(
        self, work: Work, result, queue_ms: float, forward_ms: float, batch_size: int
    ) -> Verdict:
        """Stopping, compare-and-append commit and the Verdict of one verify row whose rejection rule gave
        ``result`` (a RejectionResult: n accepted draft tokens, then the recovered or bonus token; none after a
        full bonus_drafted block). ``result`` may instead be the row's logits [block.num_scored_positions,
        vocab_size] (numpy or torch): the rejection rule then runs here on that one row (:meth:`_rejections`),
        as for a batch of one.

        ``queue_ms``/``forward_ms``: the block's wait and the forward pass's wall time, ms; ``batch_size``:
        verify blocks in the forward pass.

        The replica's copy of the session (committed ids, seq, finish state, stopping state) moves only once the
        store commit succeeded. The KV cache needs no roll-back: positions past the committed length are
        overwritten by the next forward pass.

        Raises:
            InvalidRequestError, SessionNotFoundError, PreconditionError, StaleSessionError: the store refused
                the commit (this replica's copy is stale): the session is released here, nothing is committed.
            VerifierUnavailableError: the store did not answer: the verdict is kept as the session's
                ``unconfirmed`` one, for :meth:`SessionTable.settle` to check against the store.
            TargetOutputError: (given logits) the row's logits cannot be verified; the session is released.
        """
        if not isinstance(result, RejectionResult):
            result = self._rejections([work], [result])[0]
            if isinstance(result, BaseException):
                raise result
        session, block = work.session, work.block
        record = session.record
        committed_length = record.committed_length
        n = result.num_accepted
        # stopping: the earliest stop in the candidates wins, nothing after it is committed. The stopping state
        # moves with the commit only: a failed commit puts it back, so a retried block is counted once.
        stop_state = session.stop.checkpoint()
        candidates = [*block.draft_token_ids[:n]] + ([result.next_token_id] if result.next_token_id >= 0 else [])
        num_committed, reason = session.stop.append(candidates)
        committed = candidates[:num_committed]
        verdict = make_verdict(work, result.next_token_id, n, num_committed, committed, reason, queue_ms,
                                forward_ms, batch_size)
        verdict.logprobs = committed_logprobs(work.raw_logprobs, committed)  # None unless the session asked
        # the commit: compare-and-append on the committed length
        try:
            self.store.append_committed(
                record.session_id, committed_length, committed, work.seq, verdict.finished, reason, time.time(),
                verifier_id=self.sessions.info.verifier_id, logprobs=verdict.logprobs,
            )
        except (InvalidRequestError, SessionNotFoundError, PreconditionError, StaleSessionError):
            # the store moved on without us (another replica committed, or the session expired/finished):
            # our copy is stale; drop it so the next block resumes from the store
            session.stop.restore(stop_state)
            self.sessions.release(record.session_id)
            raise
        except VerifierUnavailableError:
            # the store did not answer: the commit may or may not have landed (a lost reply). Nothing moves
            # here; the session's next request settles it from the store (SessionTable.settle)
            session.stop.restore(stop_state)
            session.unconfirmed = verdict
            raise
        except BaseException:
            session.stop.restore(stop_state)
            raise
        session.confirm(verdict)
        if work.full_block is not None:
            judged = len(block.draft_token_ids)
            self.verify_policy.observe_verdict(work.full_block, judged, result.num_accepted)
            metrics.observe_verify_positions(len(work.full_block.draft_token_ids), judged)
        self.sessions.cache_committed(session)  # its newly final full pages, for sessions opening from now on
        # speculative positions judged: a cut block's m draft tokens all were (it has no bonus position of its own)
        spec = block.num_speculative_tokens if block is work.full_block else len(block.draft_token_ids)
        metrics.observe_verdict(spec, min(verdict.num_accepted, spec), len(committed), queue_ms / 1000, session.draft)
        return verdict
