"""The cloud verifier's API: open sessions, verify draft blocks, close sessions.

One :class:`Verifier` serves many edge sessions over one target model. It is a thin layer over three parts:

- :mod:`cloud_verifier.session.validation`: what a request or a draft block must satisfy (checked before anything
  changes);
- :mod:`cloud_verifier.session.table`: the session table (admission, chunked prefill, resume from the store,
  deferred KV release, reaping idle sessions, gauges);
- :mod:`cloud_verifier.batcher`: the batched verify step (one target forward pass over the blocks of many
  sessions, then the rejection rule, stopping and the compare-and-append commit per block).

Session metadata lives in a :class:`cloud_verifier.store.SessionStore` (Redis in production): committed token
ids, sampling parameters, seed, owner replica. A session unknown to this replica but present in the store (its
replica crashed or drained) is resumed here by re-prefilling its committed tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Literal

from specdec_runtime.cloud_verifier.drafts.ledger import AcceptanceLedger
from specdec_runtime.cloud_verifier.batcher import Batcher
from specdec_runtime.cloud_verifier.security.limits import TenantLimits
from specdec_runtime.cloud_verifier.kv.prefix_cache import attach_prefix_cache
from specdec_runtime.cloud_verifier.session.features import (check_features_from, resolve_request,
                                                              take_prompt_features)
from specdec_runtime.cloud_verifier.session.grammar import check_grammar, register_target
from specdec_runtime.cloud_verifier.session.table import SessionTable
from specdec_runtime.cloud_verifier.store import MemorySessionStore, SessionRecord, SessionStore, extend_conflict
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.session.validation import check_extend_request, check_open_request, validate_block
from specdec_runtime.cloud_verifier.verify_policy import VerifyPolicy, make_verify_policy
from specdec_runtime.cloud_verifier.verify_policy.cost_table import CostTableCache, target_key
from specdec_runtime.cloud_verifier.verify_policy.profiler import QUIET_S, CostProfiler
from specdec_runtime.common.errors import SessionNotFoundError, VerifierUnavailableError
from specdec_runtime.common.types import DraftBlock, SamplingParams, ServedInfo, SessionOpened, StoppingCriteria, Verdict
from specdec_runtime.common.vocab import tokenizer_fingerprint


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
        straggler_wait_fraction: longest wait for the next blocks of the sessions the last step answered, as a
            fraction of the last forward pass (:class:`cloud_verifier.batcher.Batcher`).
        prefill_chunk_tokens: prompt tokens prefilled per forward pass.
        session_ttl_s: idle time after which a session is freed, s.
        reap_interval_s: how often idle sessions are looked for, s.
        busy_wait_s: how long a block waits for the previous block of its session to end (e.g. one whose
            stream the client cancelled and resent at once) before it is refused as a second block in flight, s.
        tenant_limits: per-tenant session cap and verify rate (:mod:`cloud_verifier.security.limits`); None = none.
        prefix_caching: share the KV pages of identical leading tokens across sessions
            (:mod:`cloud_verifier.kv.prefix_cache`); False = off. Always off for hybrid targets (a cached page holds
            KV, not the recurrent state after it).
        prefix_cache_salt: ``"none"`` (shared by every tenant) or ``"tenant"`` (shared within a tenant only).
        verify_policy: how much of each block a batch step verifies: ``"adaptive"`` (the lengths that maximise the
            step's expected tokens/s; the default), ``"fixed"`` (every drafted position), or a
            :class:`~cloud_verifier.verify_policy.VerifyPolicy` (docs/verification.md).
        cost_table_dir: where the adaptive policy's cost tables are saved and read
            (:mod:`cloud_verifier.verify_policy.cost_table`): None = ``<specdec cache dir>/cost-tables``, False =
            none (every start probes, and profiles in the background).
        profile_quiet_s: the background profile runs a pass only after this long without work, s.

    Tenants: every session belongs to the tenant that opened it (``tenant_id``, "" without authentication);
    the methods taking a ``tenant_id`` answer another tenant's session exactly as an unknown one.
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
        straggler_wait_fraction: float = 0.05,
        prefill_chunk_tokens: int = 256,
        session_ttl_s: int = 600,
        reap_interval_s: float = 5.0,
        busy_wait_s: float = 30.0,
        tenant_limits: TenantLimits | None = None,
        prefix_caching: bool = True,
        prefix_cache_salt: str = "none",
        verify_policy: str | VerifyPolicy = "adaptive",
        cost_table_dir: str | os.PathLike | Literal[False] | None = None,
        profile_quiet_s: float = QUIET_S,
    ):
        self.target = target
        self.limits = tenant_limits if tenant_limits is not None else TenantLimits()  # per-tenant caps (limits.py)
        self.busy_wait_s = busy_wait_s
        self.store = store if store is not None else MemorySessionStore(ttl_s=session_ttl_s)
        self.ledger = AcceptanceLedger(self.store)  # acceptance per draft version (cloud_verifier.drafts.ledger)
        self.reap_interval_s = reap_interval_s
        tok = target.tokenizer
        # token ids at or past it are padded logit columns, not tokens
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
        register_target(self.info.model_id, tok, self.eos_token_ids)  # structured output's tokenizer
        # one cache per target runner (its KV pool), configured by the latest verifier over it
        # hybrid targets share no prefix: a cached page holds KV, not the recurrent state after it
        attach_prefix_cache(target, self.info.model_id, prefix_caching and not target.recurrent_layers,
                            prefix_cache_salt)
        # the table prefills through the batcher, the batcher counts and releases sessions in the table
        self.sessions = SessionTable(
            target, self.store, self.info, self.eos_token_ids,
            lambda session, tokens, start: self.batcher.prefill(session, tokens, start),
            max_sessions=max_sessions, prefill_chunk_tokens=prefill_chunk_tokens, session_ttl_s=session_ttl_s,
            ledger=self.ledger,
        )
        self.batcher = Batcher(
            target, self.store, self.sessions, valid_vocab_size=self.valid_vocab_size,
            max_batch_size=max_batch_size, max_batch_wait_ms=max_batch_wait_ms,
            straggler_wait_fraction=straggler_wait_fraction,
            verify_policy=make_verify_policy(verify_policy) if isinstance(verify_policy, str) else verify_policy,
        )
        self._reaper: asyncio.Task | None = None
        self.cost_tables = None if cost_table_dir is False else CostTableCache(cost_table_dir)
        self.profile_quiet_s = profile_quiet_s
        self.profiler: CostProfiler | None = None  # the cost model's prior and background profile, once started

    @classmethod
    def from_settings(cls, settings) -> "Verifier":
        """Build from :class:`cloud_verifier.config.VerifierSettings` (loads the target, makes the store).

        Raises:
            ValueError: unknown device or dtype, or a CUDA device where CUDA is not available (one line).
            common.paths.ModelNotFoundError: the target directory is not a causal-LM directory.
        """
        from specdec_runtime.cloud_verifier.store import make_store
        from specdec_runtime.common.paths import default_model_paths

        if settings.tensor_parallel > 1:  # ranks 1..N-1 started here (cloud_verifier.parallel)
            from specdec_runtime.cloud_verifier.parallel import start_from_settings

            store = make_store(settings)  # a store that fails does so before any rank starts
            runner = start_from_settings(settings)
        else:  # the store after the target, as before: a Redis still forming while the target loads is fine
            runner = TargetRunner(settings.target or default_model_paths().target_dir,
                                  kv_cache_budget_tokens=settings.kv_cache_budget_tokens,
                                  kv_page_size=settings.kv_page_size, device=settings.device, dtype=settings.dtype,
                                  num_threads=settings.torch_threads, compile_mode=settings.compile)
            store = make_store(settings)
        return cls(
            runner, store, verifier_id=settings.verifier_id, model_id=settings.model_id,
            max_num_speculative_tokens=settings.max_num_speculative_tokens, max_sessions=settings.max_sessions,
            max_batch_size=settings.max_batch_size, max_batch_wait_ms=settings.max_batch_wait_ms,
            straggler_wait_fraction=settings.straggler_wait_fraction,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            session_ttl_s=settings.session_ttl_s, reap_interval_s=settings.reap_interval_s,
            tenant_limits=TenantLimits(settings.tenant_max_sessions, settings.tenant_tokens_per_s,
                                       settings.tenant_tokens_burst, min_burst=settings.max_num_speculative_tokens + 1),
            prefix_caching=settings.prefix_caching, prefix_cache_salt=settings.prefix_cache_salt,
            verify_policy=settings.verify_policy)

    # ------------------------------------------------------------------ batching knobs (benchmarks change them)
    @property
    def max_batch_size(self) -> int:
        """Most queued items taken per forward pass; read by the batcher before each batch."""
        return self.batcher.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        self.batcher.max_batch_size = value

    @property
    def max_batch_wait_s(self) -> float:
        """Longest wait for more blocks once one is waiting, s."""
        return self.batcher.max_batch_wait_s

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the batcher and the idle-session reaper on the running event loop; the verifier serves once this
        returns. A verify policy that reads a cost model gets its prior first (the saved cost table, or one probe
        pass: milliseconds to a fraction of a second) and is profiled in the background, only while the verifier
        holds no session and has no work (:mod:`cloud_verifier.verify_policy.profiler`)."""
        if self._reaper is not None:
            return
        self.batcher.start()
        self._reaper = asyncio.create_task(self.sessions.reap_loop(self.reap_interval_s))
        policy = self.batcher.verify_policy
        if policy.uses_cost_model and self.target is not None:
            b = self.batcher
            # a held session may send its next block at any moment: the background profile waits for none
            self.profiler = CostProfiler(
                self.target, policy.cost, run_on_target=b.run_on_target, idle_s=b.idle_s,
                busy=lambda: b.busy() or self.sessions.num_sessions > 0,
                pages_lock=self.sessions.lock, cache=self.cost_tables, quiet_s=self.profile_quiet_s,
                key=target_key(self.target, self.info.model_id) if self.cost_tables is not None else None)
            await self.profiler.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new work, let queued and running blocks finish (up to ``grace_s`` s), give up this replica's
        sessions in the store (another replica resumes each at its next block), then stop."""
        if self.profiler is not None:
            await self.profiler.stop()
        await self.batcher.stop(grace_s)
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        given_up = await asyncio.to_thread(self.sessions.disown_all)
        if given_up:
            logging.getLogger(__name__).info("gave up %d sessions in the store", given_up)

    def stuck_reason(self, stuck_after_s: float) -> str | None:
        """Why the batch loop is stuck (no heartbeat for ``stuck_after_s`` s: a forward pass that does not end,
        or the loop died), or None."""
        age = self.batcher.heartbeat_age_s()
        if self.batcher.running and age > stuck_after_s:
            return f"batch loop stuck: no heartbeat for {age:.1f} s"
        return None

    def check_health(self, stuck_after_s: float) -> str | None:
        """Why this replica cannot serve now, or None when it can: the batch loop is stuck
        (:meth:`stuck_reason`), or the session store does not answer. Blocks for up to the store's socket
        timeout: call it from a worker thread."""
        stuck = self.stuck_reason(stuck_after_s)
        if stuck is not None:
            return stuck
        parallel = getattr(self.target, "parallel", None)  # a tensor-parallel target whose ranks failed
        if parallel is not None and parallel.failure is not None:
            return f"tensor parallel: {parallel.failure}"
        if not self.store.ping():
            return "session store unreachable"
        return None

    def shutdown(self) -> None:
        """Free every session's KV cache (their store records stay, so another replica can resume them); the
        ranks of a tensor-parallel target stop."""
        self.sessions.free_all()
        self.batcher.close()
        if getattr(self.target, "parallel", None) is not None:  # tensor parallel: the other ranks stop too
            self.target.parallel.close()

    # ------------------------------------------------------------------ sessions
    async def open_session(
        self, prompt_token_ids: list[int], sampling: SamplingParams, stopping: StoppingCriteria,
        tokenizer_fingerprint: str = "", tenant_id: str = "", num_output_tokens: int = 0,
        draft_name: str = "", draft_version: str = "", features=None,
    ) -> SessionOpened:
        """Validate, reserve a KV cache, prefill the prompt (chunked, interleaved with verify steps), record the
        session as ``tenant_id``'s. ``num_output_tokens``: the last prompt ids that are output already generated
        (a re-open after failover): penalties, min_tokens and max_new_tokens count them, as the lost session did.
        ``draft_name``/``draft_version``: the draft it drafts with (its acceptance counts per version: ledger).
        ``features`` (a common.features.FeatureRequest): the answer carries the prompt's, from the prefill.

        Raises:
            InvalidRequestError: empty prompt, token id out of range, prompt fills the context, bad params/features.
            PreconditionError: tokenizer fingerprint differs from the target's.
            CapacityError: max_sessions reached or no KV budget left; RateLimitedError (a CapacityError): the
                tenant holds its ``tenant_max_sessions``.
            VerifierUnavailableError: shutting down.
        """
        self._check_running()
        prompt = [int(t) for t in prompt_token_ids]
        check_open_request(prompt, sampling, stopping, tokenizer_fingerprint, self.info, self.valid_vocab_size,
                           num_output_tokens)
        check_grammar(sampling.grammar, self.info.model_id, stopping)  # the engine's message when it cannot compile
        features = resolve_request(features, self.target.num_layers)
        held = self.sessions.tenant_session_count(tenant_id) if self.limits.max_sessions is not None else 0
        label = f"{draft_name}@{draft_version}" if draft_name and draft_version else ""
        with self.limits.opening(tenant_id, held):
            session = await self.sessions.open(prompt, sampling, stopping, tenant_id, num_output_tokens, features,
                                               label)
        r = session.record
        return SessionOpened.of(self.info, r.session_id, r.committed_length, r.seed, take_prompt_features(session))

    async def extend_session(self, session_id: str, committed_length: int, appended_token_ids: list[int],
                             sampling: SamplingParams | None = None, stopping: StoppingCriteria | None = None,
                             tenant_id: str = "", features=None, features_from: int | None = None) -> SessionOpened:
        """Continue a finished (or not started) session of ``tenant_id`` with the next turn of a conversation:
        append ``appended_token_ids`` to its committed ids, prefill only those (chunked, interleaved with verify
        steps; the KV cache of the conversation so far is kept), reset its stopping state (``max_new_tokens``
        counts from the new committed length) and record the turn in the store, so any replica can resume the
        conversation. A session this replica does not hold is resumed from the store first.

        Args:
            committed_length: the session's committed length (tokens) the caller expects: a compare-and-set
                fence for retries after a failover (a retry whose first attempt was applied fails with
                ConflictError; GetSession then shows the appended ids).
            appended_token_ids: [num_appended] token ids (common.chat.continuation_ids), non-empty.
            sampling: the new turn's logits processing (None: the session's); ``seed`` None keeps the session's
                seed (draws depend on seed and absolute position only: a seeded turn equals a fresh session
                over the whole conversation with that seed).
            stopping: the new turn's stopping criteria (None: the session's).
            features: a common.features.FeatureRequest: the answer carries the features of the positions the
                turn's prefill feeds (the last committed token, then the appended ids but the last).
            features_from: with ``features``, the first position whose features the caller lacks (a failover):
                a resume here keeps them, and the answer starts with them (DraftBlock.features_from).

        Returns:
            SessionOpened with ``committed_length`` = the new committed length and the seed the turn draws with.

        Raises:
            SessionNotFoundError: unknown, closed or expired session, or another tenant's (NOT_FOUND).
            ConflictError: ``committed_length`` differs from the session's (ABORTED); nothing changes.
            PreconditionError: the session is generating (FAILED_PRECONDITION), or is for another model.
            ContextLengthError: the conversation would reach the context length (OUT_OF_RANGE).
            InvalidRequestError: no tokens, ids outside the vocabulary, bad parameters or features_from
                (INVALID_ARGUMENT).
            CapacityError: no KV budget for the longer session, or none to resume it here.
            VerifierUnavailableError: shutting down, or the store is unreachable.
        """
        self._check_running()
        appended = [int(t) for t in appended_token_ids]
        features = resolve_request(features, self.target.num_layers)  # a resume below may keep them
        check_features_from(features, features_from, committed_length)
        held = self.sessions.held(session_id)
        if held is None or held.record.committed_length != committed_length:
            # the store is the truth: a conflict is answered from it, without resuming (moving) the session
            record = self.store.get(session_id)
            if record is None or record.tenant_id != tenant_id:
                raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
            if record.committed_length != committed_length:
                raise extend_conflict(session_id, committed_length, record.committed_length)
        session = await self.sessions.get_or_resume(session_id, tenant_id, features, features_from)
        if session.busy:
            await self.sessions.wait_idle(session, self.busy_wait_s)
        if session.unconfirmed is not None and not session.busy:
            self.sessions.settle(session)  # the last block's unanswered commit, from the store
        if session.released or (committed_length != session.record.committed_length
                                 and self.sessions.is_stale(session)):
            self.sessions.release(session_id)  # the store moved on without this copy: it has the truth
            session = await self.sessions.get_or_resume(session_id, tenant_id, features, features_from)
        r = session.record
        sampling = sampling if sampling is not None else r.sampling
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=r.seed)  # every other field kept
        stopping = stopping if stopping is not None else r.stopping
        check_extend_request(r.committed_length, appended, sampling, stopping, self.info, self.valid_vocab_size)
        check_grammar(sampling.grammar, self.info.model_id, stopping)
        session = await self.sessions.extend(session, committed_length, appended, sampling, stopping, features)
        return SessionOpened.of(self.info, session_id, session.record.committed_length, session.record.seed,
                                take_prompt_features(session, features_from))

    def get_session(self, session_id: str, tenant_id: str = "") -> SessionRecord:
        """The session's record (from the store: the source of truth for committed tokens).

        Raises:
            SessionNotFoundError: unknown, closed or expired, or another tenant's than ``tenant_id``.
        """
        record = self.store.get(session_id)
        if record is None or record.tenant_id != tenant_id:
            raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
        return record

    def close_session(self, session_id: str, tenant_id: str = "") -> bool:
        """Free the session's KV cache and delete its store keys; False if it did not exist. Another tenant's
        session is left alone and answered as an unknown one (False)."""
        held = self.sessions.held(session_id)
        record = held.record if held is not None else self.store.get(session_id)
        if record is not None and record.tenant_id != tenant_id:
            return False
        return self.sessions.close(session_id)

    def reap_expired(self, now: float | None = None) -> int:
        """Free sessions idle for longer than the TTL (and those whose store record expired); ``now``: unix
        time, s. Returns the count."""
        return self.sessions.reap_expired(now)

    @property
    def num_sessions(self) -> int:
        """Sessions held on this replica."""
        return self.sessions.num_sessions

    # ------------------------------------------------------------------ verify
    async def verify(self, session_id: str, seq: int, committed_length: int, block: DraftBlock,
                     tenant_id: str = "") -> Verdict:
        """Verify one draft block of a session of ``tenant_id`` (batched with other sessions' blocks).

        Raises:
            SessionNotFoundError: unknown or expired session, or another tenant's.
            InvalidRequestError: malformed block, or ``features_from`` without features or past
                ``committed_length`` - 1 (nothing committed changes).
            PreconditionError: the session already finished.
            RateLimitedError: the tenant is over its verify rate (nothing committed changes).
            TargetOutputError: the target's logits for this block were not finite (nothing committed changes).
            VerifierUnavailableError: shutting down.
        """
        self._check_running()
        if block.features is not None:
            block = dataclasses.replace(block, features=resolve_request(block.features, self.target.num_layers))
        check_features_from(block.features, block.features_from, committed_length)
        self.limits.charge(tenant_id, len(block.draft_token_ids) + 1)
        session, answered = await self.sessions.session_for_block(session_id, seq, committed_length, tenant_id,
                                                                   self.busy_wait_s, block)
        if answered is not None:  # a retry of a block whose commit landed but whose answer was lost
            return answered
        checks = functools.partial(validate_block, session, seq, committed_length, block, self.info,
                                   self.valid_vocab_size)
        with self.sessions.block_in_flight(session, checks):
            return await self.batcher.verify(session, seq, committed_length, block)

    def _check_running(self) -> None:
        if not self.batcher.running:
            raise VerifierUnavailableError("verifier is not running (shutting down or not started)")
