"""Cloud decode on the edge: the verifier generates a session's tokens (specdec.v1 ``Decode``) and the edge
commits them as they stream in (:func:`cloud_verdicts`).

Each verdict is one γ = 0 verify step on the verifier (cloud_verifier.serving.decode_stream): ``num_accepted`` 0, the
bonus token, the committed length after it. The edge never drafts meanwhile; the session's seq advances by one
per token, so speculative blocks can follow at once (``seq`` = the last verdict's + 1).

Transports:

- a :class:`~edge_client.transport.grpc_backend.GrpcBackend` (``decode``): one streaming call; one network round trip
  before the first token, then the tokens arrive as the verifier makes them; :meth:`CloudStream.stop` ends it at
  a token boundary (``StopDecode``: the step in progress commits and is streamed, then the stream ends);
- a :class:`~edge_client.transport.failover.FailoverBackend` (``connection``): the same on its current connection; when the
  connection fails mid-stream (UNAVAILABLE, a reset), the tokens the verifier committed whose verdicts were lost
  are read back from the store (GetSession: the committed ids are the truth) and the stream is resumed at the
  new committed length on the next connection — no token lost, none repeated;
- any other backend (in-process, the simulated network of edge_client.transport.netsim): one empty block per token
  (``submit``), a round trip each: the cloud-only baseline the benchmarks used before ``Decode`` existed.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterator

from specdec_runtime.common.errors import InvalidRequestError, PreconditionError, SpecdecError
from specdec_runtime.common.types import DraftBlock, Verdict
from specdec_runtime.common.wire import finish_reason_from_proto, session_logprobs, verdict_from_proto
from specdec_runtime.edge_client.transport.backend import Reconnects, SentBlock, StreamsDecode, VerifierBackend
from specdec_runtime.edge_client.transport.retry import RetryPolicy, exhausted_error, is_retryable

__all__ = ["CloudStream", "can_stop", "cloud_verdicts", "supports_stream"]


def supports_stream(backend: VerifierBackend) -> bool:
    """True when ``backend`` reaches a verifier over gRPC (the ``Decode`` stream), False for the per-token
    fallback."""
    return isinstance(backend, (Reconnects, StreamsDecode))


def can_stop(backend: VerifierBackend) -> bool:
    """True when a :class:`CloudStream` on ``backend`` can be stopped at a token boundary: the per-token
    fallback always can; a gRPC connection unless its verifier answered StopDecode UNIMPLEMENTED."""
    conn = backend.connection() if isinstance(backend, Reconnects) else backend
    return not isinstance(conn, StreamsDecode) or bool(conn.can_stop_decode)


def cloud_verdicts(backend: VerifierBackend, session_id: str, seq: int, committed_length: int,
                   max_tokens: int = 0, timeout_s: float = 60.0,
                   on_call: Callable[[], None] | None = None, features=None) -> "CloudStream":
    """Verdicts of cloud decode from ``committed_length`` (the first step's seq: ``seq``), one per token, until
    ``max_tokens`` tokens (0: no limit), the session finishes, or :meth:`CloudStream.stop`. Closing the iterator
    cancels the call (the verifier stops at its next step; a step already in a forward pass is committed,
    GetSession shows it). ``on_call``: run once when the first request has been sent (the iteration starts it).
    ``features``: a common.features.FeatureRequest (a draft head's): each verdict carries the target's feature of
    the position it commits (``Verdict.features``; tokens read back from the store after a failover have none,
    and the stream resumed after them asks for theirs: ``DecodeRequest.features_from``).

    Raises (while iterating):
        the verifier's errors (common.errors): SessionNotFoundError, InvalidRequestError, PreconditionError,
        RateLimitedError; VerifierUnavailableError when no connection recovers within the retry budget.
    """
    return CloudStream(backend, session_id, seq, committed_length, max_tokens, timeout_s, on_call, features)


class CloudStream:
    """An iterator of cloud-decode verdicts (:func:`cloud_verdicts`) that can be stopped at a token boundary:
    after :meth:`stop`, the verdicts of the steps the verifier committed meanwhile still come (read on to the
    end), then the iteration ends; no token is lost and none is committed without its verdict reaching the
    caller (StopDecode ends the call after its step in progress; the per-token fallback sends no further
    block; after a failover the store's committed ids are read and nothing is resumed)."""

    def __init__(self, backend: VerifierBackend, session_id: str, seq: int, committed_length: int,
                 max_tokens: int, timeout_s: float, on_call: Callable[[], None] | None = None, features=None):
        self.session_id = session_id
        self._features = features  # common.features.FeatureRequest or None (nothing asked: the wire unchanged)
        self._on_call = on_call
        self.stopping = False
        self._live: tuple[StreamsDecode, int, bool] | None = None  # the Decode call in progress (_one_stream)
        if isinstance(backend, Reconnects):
            self._it = self._with_failover(backend, seq, committed_length, max_tokens)
        elif isinstance(backend, StreamsDecode):
            self._it = self._one_stream(backend, seq, committed_length, max_tokens)
        else:
            self._it = self._per_token(backend, seq, committed_length, max_tokens, timeout_s)

    def __iter__(self) -> "CloudStream":
        return self

    def __next__(self) -> Verdict:
        return next(self._it)

    def close(self) -> None:
        """Cancel the call (an edge-side stop): the verifier stops at its next step."""
        self._it.close()

    def stop(self) -> None:
        """End the stream at the next token boundary the verifier reaches (one network trip away); keep
        iterating to receive the tokens committed until then. Over a verifier without StopDecode the stream ends
        at its ``max_tokens`` as before. May be called from another thread than the iterating one."""
        if self.stopping:
            return
        self.stopping = True
        self._send_stop()

    def _send_stop(self) -> None:
        """StopDecode for the call in progress once it has answered (the verifier runs it, so the stop cannot
        overtake its start); before that, its first verdict sends it."""
        live = self._live
        if live is not None and live[2]:
            live[0].stop_decode(self.session_id, live[1])

    def _called(self) -> None:
        """The first request is on its way: run ``on_call`` once."""
        on_call, self._on_call = self._on_call, None
        if on_call is not None:
            on_call()

    def _one_stream(self, conn: StreamsDecode, seq: int, committed_length: int, max_tokens: int,
                    features_from: int | None = None) -> Iterator[Verdict]:
        """One Decode call on one GrpcBackend; gRPC errors raised as common.errors (edge_client.transport.errors).
        ``features_from``: the first position whose features the caller lacks (asked with the features only)."""
        import grpc

        from specdec_runtime.edge_client.transport.errors import map_rpc_error

        asked = {} if self._features is None else {"features": self._features}
        if asked and features_from is not None:
            asked["features_from"] = features_from
        call = conn.decode(self.session_id, seq, committed_length, max_tokens, **asked)
        self._live = (conn, seq, False)  # (connection, first seq, answered)
        self._called()
        try:
            for msg in call:
                if not self._live[2]:
                    self._live = (conn, seq, True)
                    if self.stopping:  # asked before the call answered (or between two calls: a failover)
                        self._send_stop()
                verdict = verdict_from_proto(msg, [], committed_length)
                committed_length = verdict.committed_length
                yield verdict
        except grpc.RpcError as e:
            raise map_rpc_error(e, conn.address, False) from None
        finally:
            self._live = None
            call.cancel()  # no-op once the stream ended; stops the verifier's loop when the consumer stopped early

    def _with_failover(self, backend: Reconnects, seq: int, committed_length: int, max_tokens: int) -> Iterator[Verdict]:
        """:meth:`_one_stream` on the failover backend's connection; a retryable failure is recovered from the
        store (tokens committed without their verdict) and the stream resumed on the next connection, unless it
        was stopped. Asking for features, the resumed stream says it lacks them from the first position whose
        verdict did not come (a replica that resumes the session for it sends those it recomputes)."""
        policy: RetryPolicy = backend.policy
        rng, failures, first_failure, made = random.Random(0), 0, None, 0
        lacks = None  # the first position without features since the last verdict a stream brought
        while max_tokens == 0 or made < max_tokens:
            conn = None
            try:
                conn = backend.connection()
                if not isinstance(conn, StreamsDecode):
                    raise PreconditionError(f"{type(conn).__name__} cannot stream cloud decode (no decode())")
                left = 0 if max_tokens == 0 else max_tokens - made
                for verdict in self._one_stream(conn, seq, committed_length, left, lacks):
                    seq, committed_length, made, lacks = seq + 1, verdict.committed_length, made + 1, None
                    yield verdict
                return
            except SpecdecError as e:
                # a committed-length mismatch right after a reconnect: a step of the lost stream landed after the
                # store was read; read it again
                mismatch = isinstance(e, InvalidRequestError) and failures > 0
                if not (is_retryable(e) or mismatch):
                    raise
                if conn is not None and not mismatch:
                    backend.drop_connection(conn)
                failures += 1
                first_failure = first_failure or time.monotonic()
                if failures >= policy.max_attempts or time.monotonic() - first_failure > policy.budget_s:
                    raise exhausted_error("Decode", failures, time.monotonic() - first_failure, e) from None
                time.sleep(policy.backoff_s(failures - 1, rng))
            lacks = committed_length - 1 if lacks is None else lacks
            for verdict in _from_store(backend, self.session_id, committed_length):
                seq, committed_length, made = seq + 1, verdict.committed_length, made + 1
                yield verdict
                if verdict.finished:
                    return
            backend.num_failovers += 1
            if self.stopping:  # the store holds what the lost call committed: that is the stream's end
                return

    def _per_token(self, backend, seq: int, committed_length: int, max_tokens: int,
                   timeout_s: float) -> Iterator[Verdict]:
        """One empty block per token through ``submit`` (a round trip each): a stop takes effect at once."""
        made = 0
        while (max_tokens == 0 or made < max_tokens) and not self.stopping:
            sent = SentBlock(backend, self.session_id, seq, committed_length, DraftBlock([], features=self._features))
            self._called()
            verdict, _ = sent.wait(timeout_s)
            seq, committed_length, made = seq + 1, verdict.committed_length, made + 1
            yield verdict
            if verdict.finished:
                return


def _from_store(backend, session_id: str, committed_length: int) -> Iterator[Verdict]:
    """Verdicts of the tokens the store holds past ``committed_length`` (committed, their verdicts lost), with
    their logprobs when the session asked for them."""
    info = backend.get_session(session_id)
    ids = list(info.committed_token_ids)
    for i in range(committed_length, len(ids)):
        last = i == len(ids) - 1
        yield Verdict(0, int(ids[i]), False, [int(ids[i])], i + 1, finished=bool(info.finished and last),
                      finish_reason=finish_reason_from_proto(info.finish_reason) if info.finished and last else None,
                      logprobs=session_logprobs(info, i, i + 1))
