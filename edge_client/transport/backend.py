"""How the edge client reaches a verifier: the :class:`VerifierBackend` interface.

Implementations: :class:`edge_client.transport.grpc_backend.GrpcBackend` (the real edge–cloud path, gRPC),
:class:`edge_client.transport.netsim.DelayedBackend` (adds a simulated network delay to another backend) and
``specdec.embedded.LocalBackend`` (direct calls into an in-process verifier, for ``--in-process`` and benchmarks of
the bare loop). :class:`SentBlock` is one verify step through any of them (its future and round trip).
"""

from __future__ import annotations

import abc
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from specdec_runtime.common.errors import DeadlineError
from specdec_runtime.common.types import DraftBlock, SamplingParams, SessionOpened, StoppingCriteria, Verdict

__all__ = ["VerifierBackend", "SentBlock"]


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
        num_output_tokens: int = 0,
    ) -> SessionOpened:
        """OpenSession (specdec.v1): ``num_output_tokens`` of the prompt's last ids are output already generated
        (a re-open after the verifier lost a session): the verifier counts them as generated."""

    def extend_session(
        self,
        session_id: str,
        committed_length: int,
        appended_token_ids: list[int],
        sampling: SamplingParams | None = None,
        stopping: StoppingCriteria | None = None,
        timeout_s: float | None = None,
    ) -> SessionOpened:
        """Continue a finished session with the next turn of a conversation (specdec.v1 ExtendSession): append
        ``appended_token_ids`` to its ``committed_length`` committed tokens, prefill only those, keep the KV
        cache; the answer's ``committed_length`` is the new one. ``sampling``/``stopping`` None keep the
        session's. Raises SessionNotFoundError (lost or unknown session), ConflictError (committed_length
        differs), PreconditionError (generating), ContextLengthError, InvalidRequestError, CapacityError,
        VerifierUnavailableError. Backends without it raise PreconditionError (the caller opens a session)."""
        from specdec_runtime.common.errors import PreconditionError

        raise PreconditionError(f"{type(self).__name__} cannot extend sessions")

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


class SentBlock:
    """One draft block submitted through ``backend`` (:meth:`VerifierBackend.submit`), with its round trip: the
    time it was sent and the time its answer arrived (a callback registered right after sending).

    Attributes:
        future: resolves to the block's verdict (or raises a SpecdecError).
    """

    def __init__(self, backend: VerifierBackend, session_id: str, seq: int, committed_length: int,
                 block: DraftBlock) -> None:
        self._backend = backend
        self._sent_at = time.perf_counter()
        self.future = backend.submit(session_id, seq, committed_length, block)
        self._done_at: list[float] = []
        self.future.add_done_callback(lambda _f: self._done_at.append(time.perf_counter()))

    def wait(self, timeout_s: float) -> tuple[Verdict, float]:
        """The verdict and its round trip, ms (sent → answer available, not → when we looked), waiting at most
        ``timeout_s`` s, or the backend's ``max_call_s`` (its retries) when that is longer.

        Raises:
            DeadlineError: no verdict in time; any SpecdecError the backend set on the future.
        """
        timeout_s = max(timeout_s, getattr(self._backend, "max_call_s", 0.0))  # the backend's retries fit
        try:
            verdict = self.future.result(timeout=timeout_s)
        except FutureTimeoutError:
            raise DeadlineError(f"verify step took longer than {timeout_s} s") from None
        return verdict, ((self._done_at[0] if self._done_at else time.perf_counter()) - self._sent_at) * 1000
