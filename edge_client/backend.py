"""How the edge client reaches a verifier: the :class:`VerifierBackend` interface.

Two implementations: :class:`edge_client.grpc_backend.GrpcBackend` (the real edge–cloud path, gRPC) and
:class:`LocalBackend` (direct calls into an in-process :class:`cloud_verifier.verifier.Verifier`, used for
--no-network debugging and benchmarks of the bare loop).
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass

from common.types import DraftBlock, SamplingParams, StoppingCriteria, Verdict


@dataclass(frozen=True)
class SessionOpened:
    """What the verifier answers to OpenSession (fields of specdec.v1.OpenSessionResponse)."""

    session_id: str
    model_id: str
    tokenizer_fingerprint: str
    max_context_tokens: int  # tokens
    max_block_tokens: int  # tokens
    committed_length: int  # tokens (= prompt length)
    seed: int
    vocab_size: int
    verifier_id: str
    ttl_s: int


class VerifierBackend(abc.ABC):
    """The verifier as the edge sees it. Errors raised are common.errors.SpecdecError subclasses."""

    @abc.abstractmethod
    def open_session(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        tokenizer_fingerprint: str = "",
        timeout_s: float | None = None,
    ) -> SessionOpened: ...

    @abc.abstractmethod
    def submit(self, session_id: str, seq: int, committed_length: int, block: DraftBlock) -> Future[Verdict]:
        """Send one draft block; the future resolves to its verdict (or raises a SpecdecError)."""

    @abc.abstractmethod
    def close_session(self, session_id: str) -> None: ...

    def close(self) -> None:
        """Release connections/threads."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalBackend(VerifierBackend):
    """Direct calls into an in-process :class:`cloud_verifier.verifier.Verifier` (no network).

    The verifier's batcher runs on an asyncio loop in a background thread, as it would inside the server.
    """

    def __init__(self, verifier, start_timeout_s: float = 30.0):
        import asyncio
        import threading

        self.verifier = verifier
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specdec-local-verifier", daemon=True)
        self._thread.start()
        self._call(verifier.start(), start_timeout_s)

    def _call(self, coro, timeout_s: float | None = None):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def open_session(self, prompt_token_ids, sampling, stopping, tokenizer_fingerprint="", timeout_s=None):
        return self._call(
            self.verifier.open_session(prompt_token_ids, sampling, stopping, tokenizer_fingerprint), timeout_s
        )

    def submit(self, session_id, seq, committed_length, block):
        import asyncio

        return asyncio.run_coroutine_threadsafe(
            self.verifier.verify(session_id, seq, committed_length, block), self._loop
        )

    def close_session(self, session_id: str) -> None:
        self.verifier.close_session(session_id)

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            self._call(self.verifier.stop(grace_s=5.0), 10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
