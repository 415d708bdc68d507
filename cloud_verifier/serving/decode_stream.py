"""Cloud decode: the server-streaming ``Decode`` RPC, in which the verifier generates a session's tokens itself.

Each step is a verify step of an EMPTY draft block (γ = 0) through the same path as any block
(:meth:`cloud_verifier.verifier.Verifier.verify` → :meth:`cloud_verifier.batcher.Batcher.verify`): the target
scores one position, the verdict's next token is the bonus token sampled from ``target_probs`` with the
counter-based draw of its absolute position (``uniform(seed, t, TARGET_SAMPLE)``, common.rejection), stopping
and the compare-and-append commit are the batcher's. So a cloud-decode row shares forward passes with other
sessions' verify rows, a session can move between speculative blocks and cloud decode at any committed length,
and another replica resumes it from the store exactly as it resumes a speculative session.

Why not one forward pass per token outside the batcher: the whole point of a verifier is that rows of many
sessions share one forward; a separate decode loop would compete with it for the target thread.

Output equivalence (docs/routing.md): greedy cloud decode is token-identical to target-only greedy decoding
(and so to speculative decoding). Seeded sampled cloud decode is target-only sampling with the counter-based
draws (every token from p_t with ``uniform(seed, t, TARGET_SAMPLE)``); a speculative session with the same seed
is distributed identically (Leviathan et al. 2023, Algorithm 1 is lossless) but its tokens are not the same
ones: an accepted draft token at t is decided by ``uniform(seed, t, ACCEPT)`` and q_t, not by p_t's own draw.

Stopping (``StopDecode``): the client names the call (session, first seq); the stream ends after the step in
progress, which commits and is streamed as usual, so a client that reads the stream to its end holds every
token committed: the hand-over of a cloud-first start to speculation at the token the draft gets ready
(docs/routing.md). A stop for no running call (ended, on another replica) changes nothing.

Cancellation: when the client cancels the call, the step in progress is either still queued (dropped: nothing
of it runs) or in a forward pass (committed wholly, then the stream stops); GetSession shows what was committed.
Tenant limits: each step is charged one token (cloud_verifier.security.limits); a step over the tenant's rate waits the
retry hint and goes on (the stream slows down to the tenant's rate: back-pressure) unless the wait is longer
than :data:`MAX_RATE_WAIT_S`, which ends the stream with RESOURCE_EXHAUSTED and ``retry-after-ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, AsyncIterator

from specdec_runtime.common.errors import InvalidRequestError, RateLimitedError, VerifierUnavailableError
from specdec_runtime.common.types import DraftBlock, Verdict
from specdec_runtime.common.feature_wire import feature_request_from_proto
from specdec_runtime.common.wire import verdict_to_proto
from specdec_runtime.common.v1 import verifier_pb2 as pb

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.verifier import Verifier

__all__ = ["DecodeStops", "DecodeStream", "MAX_RATE_WAIT_S", "load_hint"]

MAX_RATE_WAIT_S = 5.0  # longest wait for the tenant's token bucket inside one stream, s


def load_hint(verifier: "Verifier") -> tuple[float, float]:
    """The verifier's load hint for OpenSessionResponse: (``load``, ``forward_ms``).

    ``load``: rows submitted to the batcher and not yet answered / its max batch size (0 idle; >= 1 a new row
    waits about floor(load) forward passes first). ``forward_ms``: the recent mean wall time of a forward pass
    with verify rows, ms (0 before the first; cloud_verifier.metrics.recent_forward_ms)."""
    from specdec_runtime.cloud_verifier import metrics

    batcher = verifier.batcher
    inflight = getattr(batcher, "_inflight", 0)
    return inflight / max(1, batcher.max_batch_size), metrics.recent_forward_ms()


def check_decode_request(request: pb.DecodeRequest) -> None:
    """Raises: InvalidRequestError: no session id, seq < 1, committed_length < 1 or max_tokens < 0."""
    if not request.session_id:
        raise InvalidRequestError("Decode: session_id is empty")
    if request.seq < 1:
        raise InvalidRequestError(f"Decode: seq must be >= 1 (the session's last seq + 1), got {request.seq}")
    if request.committed_length < 1:
        raise InvalidRequestError(f"Decode: committed_length must be >= 1, got {request.committed_length}")
    if request.max_tokens < 0:
        raise InvalidRequestError(f"Decode: max_tokens must be >= 0 (0: until the end), got {request.max_tokens}")


class DecodeStops:
    """The stop events of the Decode calls running on this server, keyed by (tenant, session id, first seq).
    Used from the server's event loop only (no lock)."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str, int], asyncio.Event] = {}

    @contextlib.contextmanager
    def running(self, key: tuple[str, str, int]):
        """Register a call for its lifetime; yields its stop event (a newer call with the same key replaces
        it: a client reconnecting with the same seq means the old call is dead)."""
        event = self._events[key] = asyncio.Event()
        try:
            yield event
        finally:
            if self._events.get(key) is event:
                del self._events[key]

    def stop(self, key: tuple[str, str, int]) -> bool:
        """Tell the call ``key`` to end after its step in progress; False when no such call runs here."""
        event = self._events.get(key)
        if event is None:
            return False
        event.set()
        return True


class DecodeStream:
    """One ``Decode`` call: γ = 0 verify steps of one session until ``max_tokens``, its end, or a cancel.

    Args:
        verifier: the Verifier (its ``verify`` does validation, batching, stopping and the commit).
        drain: set when the server shuts down: the stream ends with UNAVAILABLE before its next step.
        tenant_kw: ``{"tenant_id": ...}`` of the authenticated caller, or {}.
        stops: the server's :class:`DecodeStops` (None: the call cannot be stopped, only cancelled).
    """

    def __init__(self, verifier: "Verifier", drain: asyncio.Event, tenant_kw: dict[str, str],
                 stops: DecodeStops | None = None):
        self.verifier = verifier
        self.drain = drain
        self.tenant_kw = tenant_kw
        self.stops = stops if stops is not None else DecodeStops()

    async def verdicts(self, request: pb.DecodeRequest) -> AsyncIterator[pb.Verdict]:
        """One wire Verdict per step (num_accepted 0, is_bonus false as for any empty block, seq = the step's),
        as each commits.

        Raises:
            InvalidRequestError: a malformed request, or a committed length / seq that is not the session's.
            SessionNotFoundError, PreconditionError (finished session), VerifierUnavailableError (draining),
            RateLimitedError (over the tenant's rate for longer than MAX_RATE_WAIT_S), TargetOutputError.
        """
        check_decode_request(request)
        seq, committed_length, made = int(request.seq), int(request.committed_length), 0
        # a draft head's features: each step's empty block asks for them, as a speculative session's blocks do
        features = feature_request_from_proto(request.features) if request.HasField("features") else None
        # the first step only: a stream resumed here after a failover gets the features it lacks with it
        features_from = int(request.features_from) if request.HasField("features_from") else None
        key = (self.tenant_kw.get("tenant_id", ""), request.session_id, seq)
        with self.stops.running(key) as stop:
            while (request.max_tokens == 0 or made < request.max_tokens) and not stop.is_set():
                if self.drain.is_set():
                    raise VerifierUnavailableError("verifier is shutting down")
                verdict = await self._step(request.session_id, seq, committed_length, features, features_from)
                features_from = None
                yield verdict_to_proto(verdict, seq)  # a stop during the step: it is streamed, then the end
                made += len(verdict.committed_token_ids)
                seq, committed_length = seq + 1, verdict.committed_length
                if verdict.finished:
                    return

    async def _step(self, session_id: str, seq: int, committed_length: int, features=None,
                    features_from: int | None = None) -> Verdict:
        """One γ = 0 verify step (asking for ``features``, a common.features.FeatureRequest, when not None, and
        for those from ``features_from``: DraftBlock.features_from); waits out the tenant's rate limit (up to
        MAX_RATE_WAIT_S in all)."""
        waited_s = 0.0
        while True:
            try:
                return await self.verifier.verify(session_id, seq, committed_length,
                                                  DraftBlock([], features=features, features_from=features_from),
                                                  **self.tenant_kw)
            except RateLimitedError as e:  # charged before anything runs: nothing changed, wait and go on
                wait_s = e.retry_after_ms / 1000
                if waited_s + wait_s > MAX_RATE_WAIT_S:
                    raise
                waited_s += wait_s
                await asyncio.sleep(wait_s)
