"""How the edge client reaches a verifier: the :class:`VerifierBackend` interface.

Implementations: :class:`edge_client.grpc_backend.GrpcBackend` (the real edge–cloud path, gRPC),
:class:`edge_client.netsim.DelayedBackend` (adds a simulated network delay to another backend) and
``specdec.embedded.LocalBackend`` (direct calls into an in-process verifier, for ``--in-process`` and benchmarks of
the bare loop).
"""

from __future__ import annotations

import abc
from concurrent.futures import Future

from common.types import DraftBlock, SamplingParams, SessionOpened, StoppingCriteria, Verdict


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
        from common.errors import PreconditionError

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
