"""How the edge client reaches a verifier: the :class:`VerifierBackend` contract and its optional capabilities.

Implementations: :class:`edge_client.transport.grpc_backend.GrpcBackend` (the real edge–cloud path, gRPC),
:class:`edge_client.transport.failover.FailoverBackend` (several addresses, retries),
:class:`edge_client.transport.netsim.DelayedBackend` (adds a simulated network delay to another backend) and
``specdec.embedded.LocalBackend`` (direct calls into an in-process verifier, for ``--in-process`` and benchmarks of
the bare loop). :class:`SentBlock` is one verify step through any of them (its future and round trip).

What every backend must do is :class:`VerifierBackend` (open, submit, close a session). What only some can do is
declared, one small ``runtime_checkable`` protocol per capability, and the edge asks ``isinstance(backend, X)``
where it would use one; each says what it enables and what the edge does without it:

- :class:`Addressed` (``address``): named in errors; without it "?".
- :class:`StreamsDecode` (``decode``, ``stop_decode``): cloud decode as one Decode stream, stoppable at a token
  boundary; without it one empty block per token through ``submit`` (a round trip each).
- :class:`Reconnects` (``connection``, ``drop_connection``, ``get_session``, ``policy``): cloud decode that survives
  a replica's failure; without it a failure mid-stream ends the segment with its error.
- :class:`Probes` (``probe``) / :class:`ChecksHealth` (``check_health``): the device fallback's probe of the cloud;
  without either the probe says "answers" and the next OpenSession is the real test.
- :class:`CountsWire` (``wire_stats``), :class:`CountsFailovers` (``num_failovers``): the counts in
  ``GenerationResult``; without them 0.
- :class:`RetriesCalls` (``max_call_s``): a verify step waits for the backend's retries; without it the client's
  ``timeout_s`` alone bounds it.
"""

from __future__ import annotations

import abc
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

from specdec_runtime.common.errors import DeadlineError, PreconditionError
from specdec_runtime.common.types import DraftBlock, ExtendRequest, OpenRequest, SessionOpened, Verdict

if TYPE_CHECKING:
    from specdec_runtime.edge_client.stats import WireStats
    from specdec_runtime.edge_client.transport.retry import RetryPolicy

__all__ = ["VerifierBackend", "SentBlock", "Addressed", "StreamsDecode", "Reconnects", "Probes", "ChecksHealth",
           "CountsWire", "WireLedger", "CountsFailovers", "RetriesCalls", "answers", "failovers_of",
           "max_call_s_of"]


class VerifierBackend(Protocol):
    """The verifier as the edge sees it. Errors raised are common.errors.SpecdecError subclasses.

    Required: :meth:`open_session`, :meth:`submit`, :meth:`close_session`. A class that subclasses it explicitly
    inherits the defaults of :meth:`extend_session` (refused: the caller opens a session instead), :meth:`close`
    (nothing to release) and the context manager; a structural implementation writes them itself.
    """

    @abc.abstractmethod
    def open_session(self, request: OpenRequest, timeout_s: float | None = None) -> SessionOpened:
        """OpenSession (specdec.v1) with ``request`` (:class:`common.types.OpenRequest`), waiting at most
        ``timeout_s`` s (None: the backend's default; it includes the prompt's prefill).

        Raises:
            InvalidRequestError, ContextLengthError, CapacityError, PreconditionError, VerifierUnavailableError,
            DeadlineError (common.errors)."""

    def extend_session(self, request: ExtendRequest, timeout_s: float | None = None) -> SessionOpened:
        """Continue a finished session with the next turn of a conversation (specdec.v1 ExtendSession): append
        ``request.appended_token_ids`` to its ``request.committed_length`` committed tokens, prefill only those,
        keep the KV cache; the answer's ``committed_length`` is the new one. ``sampling``/``stopping`` None keep
        the session's.

        Raises:
            SessionNotFoundError (lost or unknown session), ConflictError (committed_length differs),
            PreconditionError (generating; and this default: a backend that cannot extend, so the caller opens a
            session), ContextLengthError, InvalidRequestError, CapacityError, VerifierUnavailableError."""
        raise PreconditionError(f"{type(self).__name__} cannot extend sessions")

    @abc.abstractmethod
    def submit(self, session_id: str, seq: int, committed_length: int, block: DraftBlock) -> Future[Verdict]:
        """Send one draft block (the ``seq``-th of the session, extending ``committed_length`` tokens); the
        future resolves to its verdict or raises a SpecdecError. Never blocks on the verifier."""

    @abc.abstractmethod
    def close_session(self, session_id: str) -> None:
        """Free the session on the verifier (an unknown or expired one is not an error)."""

    def close(self) -> None:
        """Release connections/threads."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------- capabilities


@runtime_checkable
class Addressed(Protocol):
    """A backend with one address ("host:port"), named in errors about it (a verify deadline's message)."""

    address: str


@runtime_checkable
class StreamsDecode(Addressed, Protocol):
    """One gRPC connection that streams cloud decode (specdec.v1 ``Decode``; :mod:`edge_client.transport.cloud_decode`).

    Enables route=cloud, auto's and cloud-first's cloud segments as one streaming call (one round trip before the
    first token) that can be stopped at a token boundary. Without it cloud decode sends one empty block per token
    through :meth:`VerifierBackend.submit` (a round trip each), still the target's tokens.
    """

    can_stop_decode: bool  # False once the verifier answered StopDecode UNIMPLEMENTED (an older verifier)

    def decode(self, session_id: str, seq: int, committed_length: int, max_tokens: int = 0,
               features=None, features_from: int | None = None) -> Iterator:
        """The Decode call: an iterator of wire Verdicts with ``cancel()``; ``features``: a
        common.features.FeatureRequest (each verdict carries its position's) or None; ``features_from``: the
        first position whose features the caller lacks (the first step's ``DraftBlock.features_from``) or None."""

    def stop_decode(self, session_id: str, seq: int) -> None:
        """End the Decode call whose first step was ``seq`` after its step in progress (best effort)."""


@runtime_checkable
class Reconnects(Protocol):
    """A backend over several connections (:class:`edge_client.transport.failover.FailoverBackend`).

    Enables cloud decode that survives a replica's failure: the stream runs on :meth:`connection`, a failed one is
    given up, the tokens committed whose verdicts were lost are read from the store (:meth:`get_session`) and the
    stream resumes on the next connection, within ``policy``'s budget. Without it a failure mid-stream ends the
    segment with its error (the generation loop re-opens or falls back as for any failed call).
    """

    policy: RetryPolicy
    num_failovers: int

    def connection(self) -> VerifierBackend:
        """The connection in use, connecting if needed. Raises VerifierUnavailableError."""

    def drop_connection(self, backend: VerifierBackend) -> None:
        """Give up ``backend`` (it failed): the next call connects to the next address."""

    def get_session(self, session_id: str, timeout_s: float = 10.0):
        """The store's record of a session (wire ``SessionInfo``). Raises SessionNotFoundError."""


@runtime_checkable
class Probes(Protocol):
    """A backend that can tell whether some verifier answers now, trying its next address when the current one
    does not. Enables the device fallback's return to the cloud (:class:`edge_client.generation.fallback.CloudProbe`)."""

    def probe(self, timeout_s: float = 2.0) -> bool:
        """True when some address answers health SERVING within ``timeout_s`` s. Never raises."""


@runtime_checkable
class ChecksHealth(Protocol):
    """A backend with a health check of its one verifier (``grpc.health.v1``); the device fallback's probe when
    the backend is not :class:`Probes`. Without either, the probe says the cloud answers at once and the next
    OpenSession is the real test (it fails again into the fallback if not)."""

    def check_health(self, timeout_s: float = 2.0) -> bool:
        """True when the verifier answers SERVING within ``timeout_s`` s; False otherwise. Never raises."""


@runtime_checkable
class CountsWire(Protocol):
    """A backend that counts the bytes it exchanges per session: ``GenerationResult.bytes_sent/received``.
    Without it they are 0."""

    def wire_stats(self, session_id: str) -> WireStats:
        """Bytes/messages exchanged for ``session_id`` so far (zeros for an unknown session)."""


@runtime_checkable
class WireLedger(CountsWire, Protocol):
    """A connection whose whole ledger can be read when it is given up
    (:class:`edge_client.transport.connections.PickFirstConnections` keeps its sessions' counts)."""

    def wire_stats_by_session(self) -> dict[str, WireStats]:
        """A copy of the counts of every session this connection tracks."""


@runtime_checkable
class CountsFailovers(Protocol):
    """A backend that completes calls on another replica after a failure: ``GenerationResult.num_failovers``
    counts them. Without it 0 is reported."""

    num_failovers: int


@runtime_checkable
class RetriesCalls(Protocol):
    """A backend whose calls may take long because it retries them: a verify step waits for ``max_call_s`` when
    that is longer than the client's ``timeout_s``. Without it the client's deadline alone bounds the step."""

    max_call_s: float


def answers(backend: object, timeout_s: float) -> bool:
    """Whether the cloud behind ``backend`` answers: its :meth:`Probes.probe`, else its
    :meth:`ChecksHealth.check_health`, else True (see :class:`ChecksHealth`)."""
    if isinstance(backend, Probes):
        return backend.probe(timeout_s)
    if isinstance(backend, ChecksHealth):
        return backend.check_health(timeout_s)
    return True


def failovers_of(backend: object) -> int:
    """``backend.num_failovers`` when it counts them (:class:`CountsFailovers`), else 0."""
    return int(backend.num_failovers) if isinstance(backend, CountsFailovers) else 0


def max_call_s_of(backend: object) -> float:
    """``backend.max_call_s`` when it retries calls (:class:`RetriesCalls`), else 0.0, s."""
    return float(backend.max_call_s) if isinstance(backend, RetriesCalls) else 0.0


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
        timeout_s = max(timeout_s, max_call_s_of(self._backend))  # the backend's retries fit
        try:
            verdict = self.future.result(timeout=timeout_s)
        except FutureTimeoutError:
            raise DeadlineError(f"verify step took longer than {timeout_s} s") from None
        return verdict, ((self._done_at[0] if self._done_at else time.perf_counter()) - self._sent_at) * 1000
