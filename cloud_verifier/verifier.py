"""The cloud verifier's API: open sessions, verify draft blocks, close sessions.

One :class:`Verifier` serves many edge sessions over one target model. It is a thin layer over three parts:

- :mod:`cloud_verifier.validation`: what a request or a draft block must satisfy (checked before anything
  changes);
- :mod:`cloud_verifier.sessions`: the session table (admission, chunked prefill, resume from the store,
  deferred KV release, reaping idle sessions, gauges);
- :mod:`cloud_verifier.batcher`: the batched verify step (one target forward pass over the blocks of many
  sessions, then the rejection rule, stopping and the compare-and-append commit per block).

Session metadata lives in a :class:`cloud_verifier.store.SessionStore` (Redis in production): committed token
ids, sampling parameters, seed, owner replica. A session unknown to this replica but present in the store (its
replica crashed or drained) is resumed here by re-prefilling its committed tokens.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from cloud_verifier.batcher import Batcher
from cloud_verifier.sessions import SessionTable
from cloud_verifier.store import MemorySessionStore, SessionRecord, SessionStore
from cloud_verifier.target import TargetRunner
from cloud_verifier.validation import check_open_request, validate_block
from common.errors import SessionNotFoundError, VerifierUnavailableError
from common.types import DraftBlock, SamplingParams, ServedInfo, SessionOpened, StoppingCriteria, Verdict
from common.vocab import tokenizer_fingerprint


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
        # the table prefills through the batcher, the batcher counts and releases sessions in the table
        self.sessions = SessionTable(
            target, self.store, self.info, self.eos_token_ids,
            lambda session, tokens, start: self.batcher.prefill(session, tokens, start),
            max_sessions=max_sessions, prefill_chunk_tokens=prefill_chunk_tokens, session_ttl_s=session_ttl_s,
        )
        self.batcher = Batcher(
            target, self.store, self.sessions, valid_vocab_size=self.valid_vocab_size,
            max_batch_size=max_batch_size, max_batch_wait_ms=max_batch_wait_ms,
        )
        self._reaper: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings) -> "Verifier":
        """Build from :class:`cloud_verifier.config.VerifierSettings` (loads the target, makes the store).

        Raises:
            ValueError: unknown device or dtype, or a CUDA device where CUDA is not available (one line).
            common.paths.ModelNotFoundError: the target directory is not a causal-LM directory.
        """
        from cloud_verifier.store import make_store
        from common.paths import default_model_paths

        target_dir = settings.target or default_model_paths().target_dir
        runner = TargetRunner(
            target_dir,
            kv_cache_budget_tokens=settings.kv_cache_budget_tokens,
            device=settings.device,
            dtype=settings.dtype,
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
        """Start the batcher and the idle-session reaper on the running event loop."""
        if self._reaper is not None:
            return
        self.batcher.start()
        self._reaper = asyncio.create_task(self.sessions.reap_loop(self.reap_interval_s))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new work, let queued and running blocks finish (up to ``grace_s`` s), then stop."""
        await self.batcher.stop(grace_s)
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    def shutdown(self) -> None:
        """Free every session's KV cache (their store records stay, so another replica can resume them)."""
        self.sessions.free_all()
        self.batcher.close()

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
        check_open_request(prompt, sampling, stopping, tokenizer_fingerprint, self.info, self.valid_vocab_size)
        record = (await self.sessions.open(prompt, sampling, stopping)).record
        return SessionOpened.of(self.info, record.session_id, record.committed_length, record.seed)

    def get_session(self, session_id: str) -> SessionRecord:
        """The session's record (from the store: the source of truth for committed tokens).

        Raises:
            SessionNotFoundError: unknown, closed or expired.
        """
        record = self.store.get(session_id)
        if record is None:
            raise SessionNotFoundError(f"unknown or expired session {session_id!r}")
        return record

    def close_session(self, session_id: str) -> bool:
        """Free the session's KV cache and delete its store keys; False if it did not exist."""
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
    async def verify(self, session_id: str, seq: int, committed_length: int, block: DraftBlock) -> Verdict:
        """Verify one draft block of a session (batched with other sessions' blocks).

        Raises:
            SessionNotFoundError: unknown or expired session.
            InvalidRequestError: malformed block (nothing committed changes).
            PreconditionError: the session already finished.
            VerifierUnavailableError: shutting down.
        """
        self._check_running()
        session = await self.sessions.get_or_resume(session_id)
        checks = functools.partial(validate_block, session, seq, committed_length, block, self.info,
                                   self.valid_vocab_size)
        with self.sessions.block_in_flight(session, checks):
            return await self.batcher.verify(session, seq, committed_length, block)

    def _check_running(self) -> None:
        if not self.batcher.running:
            raise VerifierUnavailableError("verifier is not running (shutting down or not started)")
