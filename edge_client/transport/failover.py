"""Failover in the SDK: several verifier addresses (or one balancer), and retries of the call in flight.

:class:`FailoverBackend` is a :class:`~edge_client.transport.backend.VerifierBackend` over a list of verifier addresses,
tried in the given order (pick-first: the first that answers is used until it fails), or over one load-balancer
address. When a call fails with UNAVAILABLE, a reset or broken stream (a balancer's RST_STREAM or HTTP 502 when
its upstream died), or DEADLINE_EXCEEDED (no verdict within ``attempt_timeout_s``), it is retried — the same
block, same ``seq``, same committed length — on the next address (or again through the balancer) after a
bounded, jittered exponential backoff, within a retry budget (:class:`RetryPolicy`). The replica that gets
the retry resumes the session from the shared store (Redis) by prefilling its committed tokens.

Reconciliation. The replica that failed may have committed the block before it died: the retry, which still
extends the old committed length, is then refused (INVALID_ARGUMENT: committed length mismatch). The store's
committed tokens are the truth: the backend reads the session (GetSession) from the replica that refused and
rebuilds the block's verdict from the tokens after the old committed length (:func:`verdict_from_store`), with
their logprobs when the session asked for them (the store commits them with the tokens). So a block's tokens
are counted and streamed exactly once whichever replica committed them.

Late verdicts. Each call has one live attempt; a verdict that arrives for an abandoned attempt (the replica was
given up after its deadline) is dropped. The store refuses that replica's commit anyway once another replica
holds the session (compare-and-append with an owner check), and if it committed first, the retry reconciles.

Affinity: all connections of one backend send the same ``x-specdec-client`` metadata (``client_id``), which a
balancer hashes on (deploy/nginx/nginx.conf): a session stays on one replica until that replica fails.

The address list and the connection in use are :mod:`edge_client.transport.connections`; the retry policy, which failures
are retried and the timers of deadlines and backoff waits are :mod:`edge_client.transport.retry`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from specdec_runtime.common.errors import (
    ConflictError,
    DeadlineError,
    InvalidRequestError,
    PreconditionError,
    SessionNotFoundError,
    SpecdecError,
    VerifierUnavailableError,
)
from specdec_runtime.common.types import (NO_TOKEN, DraftBlock, ExtendRequest, FinishReason, OpenRequest, SessionOpened,
                                          Verdict)
from specdec_runtime.edge_client.transport.backend import Addressed, VerifierBackend
from specdec_runtime.edge_client.transport.connections import PickFirstConnections, parse_addresses
from specdec_runtime.edge_client.transport.retry import RetryPolicy, Timers, exhausted_error, is_retryable

log = logging.getLogger(__name__)

__all__ = ["RetryPolicy", "FailoverBackend", "parse_addresses", "verdict_from_store", "is_retryable"]


def verdict_from_store(draft_token_ids: Sequence[int], committed_length: int, committed_token_ids: Sequence[int],
                       finished: bool, finish_reason: FinishReason | None, seq: int) -> Verdict:
    """The verdict of a block (``draft_token_ids`` sent at ``committed_length`` tokens) that a replica committed
    but never answered, rebuilt from the store's committed ids (prompt + output, the source of truth).

    The block committed ``new = committed_token_ids[committed_length:]``: the longest prefix of the block that
    ``new`` starts with is the accepted part; one more token is the recovered/bonus token (a recovered token
    never equals the draft token it replaces); fewer means a stop ended the session inside the accepted part.

    Raises:
        InvalidRequestError: ``new`` is empty or longer than one verdict can commit (the session moved on).
    """
    new = [int(t) for t in committed_token_ids[committed_length:]]
    n = 0
    while n < min(len(new), len(draft_token_ids)) and new[n] == int(draft_token_ids[n]):
        n += 1
    if not new or len(new) > n + 1:
        raise InvalidRequestError(
            f"the store holds {len(new)} tokens after committed length {committed_length}, which is not one "
            f"verdict on a {len(draft_token_ids)}-token block"
        )
    next_id = new[n] if len(new) == n + 1 else NO_TOKEN
    return Verdict(
        num_accepted=n,
        next_token_id=next_id,
        is_bonus=next_id != NO_TOKEN and n == len(draft_token_ids) and n > 0,
        committed_token_ids=new,
        committed_length=len(committed_token_ids),
        finished=bool(finished),
        finish_reason=finish_reason if finished else None,
        seq=int(seq),
    )


def _retry_block(call: "_Call") -> DraftBlock:
    """The block an attempt sends: the call's; a retry of one that asks for the target's features (a draft head)
    says it lacks them from the block's own first position (``features_from``), so the replica that resumes the
    session keeps those its re-prefill recomputes, for the verdicts another replica may have committed unseen."""
    block = call.block
    if not call.failures or block.features is None:
        return block
    start = call.committed_length - 1
    if block.features_from is not None:
        start = min(start, block.features_from)
    return dataclasses.replace(block, features_from=start)


class _Call:
    """One verify call (a block) and its attempts."""

    __slots__ = ("session_id", "seq", "committed_length", "block", "future", "lock", "attempt", "handled",
                 "failures", "first_failure_at", "deadline", "last_error", "attempt_started_at")

    def __init__(self, session_id: str, seq: int, committed_length: int, block: DraftBlock):
        self.session_id, self.seq, self.committed_length, self.block = session_id, seq, committed_length, block
        self.future: Future[Verdict] = Future()
        self.lock = threading.Lock()
        self.attempt = 0  # number of the live attempt
        self.handled = 0  # last attempt whose outcome was taken (a later outcome of it is ignored)
        self.failures = 0
        self.first_failure_at: float | None = None
        self.deadline: float | None = None  # monotonic time after which no retry starts, s
        self.last_error: BaseException | None = None
        self.attempt_started_at = 0.0  # monotonic time the live attempt was sent, s


class FailoverBackend(VerifierBackend):
    """Verifier backend over several addresses (pick-first, in order) or one balancer, with retries.

    Args:
        addresses: "host:port[,host:port...]" or a list; the first is preferred. One balancer address works the
            same way (retries go through it again).
        policy: the retry policy (:class:`RetryPolicy`).
        mode: transport of each connection ("stream" or "unary", see :class:`~edge_client.transport.grpc_backend.GrpcBackend`).
        client_id: affinity id sent as ``x-specdec-client`` on every call, to every address (default: random).
        connect: connect at construction (raises when no address answers); False: connect at the first call
            (an SDK with device fallback starts even when the cloud is unreachable).
        open_timeout_s: deadline of OpenSession (includes a long prompt's prefill), s.
        seed: seed of the backoff jitter (None: random).
        backend_factory: makes the connection to one address (default: a GrpcBackend with ``grpc_kwargs``).
        **grpc_kwargs: passed to each :class:`~edge_client.transport.grpc_backend.GrpcBackend` (e.g. credentials).

    Attributes:
        num_failovers: calls that failed on one replica or connection (UNAVAILABLE, broken stream, deadline) and
            were completed after a retry: a replica switch (the next address, or the balancer's next upstream).
        last_failover_ms: per recovered verify call, its first failure -> its verdict, ms (backoff, reconnect,
            the new replica's resume by prefill and the verify step).
        last_retry_ms: per recovered verify call, the retry that succeeded sent -> its verdict, ms.

    Raises:
        InvalidRequestError: no valid address. ValueError: a bad policy.
        VerifierUnavailableError: ``connect`` and no address answers within ``policy.connect_timeout_s`` each.
    """

    def __init__(self, addresses: str | Sequence[str], *, policy: RetryPolicy | None = None, mode: str = "stream",
                 client_id: str | None = None, connect: bool = True, open_timeout_s: float = 300.0,
                 seed: int | None = None, backend_factory: Callable[[str], VerifierBackend] | None = None,
                 **grpc_kwargs):
        addresses = parse_addresses(addresses)  # an invalid address is reported before a bad policy
        self.policy = policy or RetryPolicy()
        self.policy.validate()
        self.client_id = client_id or uuid.uuid4().hex
        self.open_timeout_s = open_timeout_s
        if backend_factory is None:
            from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

            def backend_factory(address: str) -> VerifierBackend:
                return GrpcBackend(address, connect_timeout_s=self.policy.connect_timeout_s, mode=mode,
                                   client_id=self.client_id, open_timeout_s=open_timeout_s, **grpc_kwargs)
        self._conns = PickFirstConnections(addresses, backend_factory, self.policy.connect_timeout_s)
        self.addresses = self._conns.addresses
        self._lock = threading.RLock()
        self._rng = random.Random(seed)
        self._opened: dict[str, SessionOpened] = {}  # last OpenSessionResponse per session (ExtendSession retries)
        self._timers = Timers()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="specdec-failover")
        self.num_failovers = 0
        self.last_failover_ms: list[float] = []  # per recovered verify call: first failure -> verdict, ms
        self.last_retry_ms: list[float] = []  # per recovered verify call: the retry that succeeded sent -> verdict, ms
        if connect:
            try:
                self._conns.current()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ connections
    @property
    def address(self) -> str:
        """The address in use (or tried next)."""
        return self._conns.address

    @property
    def max_call_s(self) -> float:
        """Longest a verify call can take, retries included, s."""
        return self.policy.max_call_s

    def wire_stats(self, session_id: str):
        """Bytes/messages exchanged for ``session_id`` over all connections (see GrpcBackend.wire_stats)."""
        return self._conns.wire_stats(session_id)

    def probe(self, timeout_s: float = 2.0) -> bool:
        """True when some address answers health SERVING now (connecting if needed); a connection that does not
        is given up, so the next probe tries the next address. Never raises."""
        return self._conns.probe(timeout_s)

    # ------------------------------------------------------------------ unary calls with retries
    def _with_retries(self, fn: Callable[[VerifierBackend], object], what: str):
        """Run ``fn(connection)``, retrying retryable failures on the next connection (policy)."""
        failures, first_failure, last = 0, None, None
        while True:
            backend = None
            try:
                backend = self._conns.current()
                result = fn(backend)
            except SpecdecError as e:
                if not is_retryable(e) or self._conns.closed:
                    raise
                self._conns.drop(backend)
                failures, last = failures + 1, e
                now = time.monotonic()
                first_failure = first_failure or now
                if failures >= self.policy.max_attempts or now - first_failure > self.policy.budget_s:
                    raise exhausted_error(what, failures, now - first_failure, last) from None
                log.info("%s failed (%s); retrying (%d of %d)", what, e, failures, self.policy.max_attempts - 1)
                time.sleep(self.policy.backoff_s(failures - 1, self._rng))
                continue
            if failures:
                with self._lock:
                    self.num_failovers += 1
            return result

    def open_session(self, request: OpenRequest, timeout_s: float | None = None) -> SessionOpened:
        """OpenSession on the current address, retried on the next ones (a session half-opened on a replica
        that died expires there by TTL); each attempt waits ``timeout_s`` (default ``open_timeout_s``).

        Raises:
            VerifierUnavailableError: no address answered within the retry budget; the verifier's errors.
        """
        opened = self._with_retries(lambda b: b.open_session(request, timeout_s=timeout_s or self.open_timeout_s),
                                    "OpenSession")
        self._remember(opened)
        return opened

    def extend_session(self, request: ExtendRequest, timeout_s: float | None = None) -> SessionOpened:
        """ExtendSession on the current address, retried on the next ones (the replica that gets the retry
        resumes the session from the store). Reconciliation: when an attempt failed after the verifier applied
        the extension (its answer lost), the retry is refused with ConflictError (the committed length moved);
        the store then shows the committed ids ending with ``appended_token_ids`` at the new length, with no
        output yet, and that counts as success (answered from the session's last OpenSessionResponse).

        Raises:
            VerifierUnavailableError: no address answered within the retry budget; the verifier's errors
            (SessionNotFoundError, ConflictError, PreconditionError, ContextLengthError, ...).
        """
        request = dataclasses.replace(request, appended_token_ids=[int(t) for t in request.appended_token_ids])
        session_id, committed_length, appended = request.session_id, request.committed_length, \
            request.appended_token_ids
        attempts = [0]

        def call(b: VerifierBackend) -> SessionOpened:
            attempts[0] += 1
            try:
                return b.extend_session(request, timeout_s=timeout_s or self.open_timeout_s)
            except ConflictError:
                if attempts[0] == 1:
                    raise
                info = b.get_session(session_id)
                known = self._opened.get(session_id)
                new_length = committed_length + len(appended)
                if (known is None or info.committed_length != new_length or info.prompt_length != new_length
                        or list(info.committed_token_ids[committed_length:]) != appended):
                    raise
                log.info("session %s: the extension was applied before a failure; reconciled from the store",
                         session_id)
                sampling = request.sampling
                seed = sampling.seed if sampling is not None and sampling.seed is not None else known.seed
                return dataclasses.replace(known, committed_length=new_length, verifier_id=info.verifier_id,
                                           seed=seed)

        opened = self._with_retries(call, "ExtendSession")
        self._remember(opened)
        return opened

    def _remember(self, opened: SessionOpened) -> None:
        """Keep the last OpenSessionResponse of a session (reconciling an ExtendSession answers from it)."""
        with self._lock:
            self._opened[opened.session_id] = opened
            while len(self._opened) > 1024:
                self._opened.pop(next(iter(self._opened)))

    def connection(self) -> VerifierBackend:
        """The connection in use, connecting if needed (calls this class does not wrap: cloud decode)."""
        return self._conns.current()

    def drop_connection(self, backend: VerifierBackend) -> None:
        """Give up ``backend`` (it failed): the next call connects to the next address."""
        self._conns.drop(backend)

    def get_session(self, session_id: str, timeout_s: float = 10.0):
        """The store's record of a session (wire ``SessionInfo``), from any replica, with retries.

        Raises:
            SessionNotFoundError: unknown or expired. VerifierUnavailableError: no replica answered.
        """
        return self._with_retries(lambda b: b.get_session(session_id, timeout_s=timeout_s), "GetSession")

    def close_session(self, session_id: str) -> None:
        """Free the session (one try: a session left behind expires by TTL)."""
        try:
            self._conns.current().close_session(session_id)
        except (VerifierUnavailableError, DeadlineError, SessionNotFoundError):
            pass

    # ------------------------------------------------------------------ verify calls with retries
    def submit(self, session_id: str, seq: int, committed_length: int, block: DraftBlock) -> Future[Verdict]:
        """Send one block; the future resolves to its verdict, after retries on other replicas if needed.

        The future raises VerifierUnavailableError when the retry budget is spent, and the verifier's own errors
        (InvalidRequestError, SessionNotFoundError, PreconditionError, ...) as they are.
        """
        call = _Call(session_id, seq, committed_length, block)
        self._attempt(call)
        return call.future

    def _attempt(self, call: _Call) -> None:
        """Start one attempt of ``call`` (never blocks on the network when connected)."""
        if call.future.done():
            return
        try:
            backend = self._conns.current()
        except SpecdecError as e:
            self._pool.submit(self._failed, call, call.attempt, None, e)
            return
        with call.lock:
            call.attempt += 1
            attempt = call.attempt
            call.attempt_started_at = time.monotonic()
        timeout = self.policy.attempt_timeout_s
        if call.deadline is not None:
            timeout = max(0.1, min(timeout, call.deadline + self.policy.attempt_timeout_s - time.monotonic()))
        inner = backend.submit(call.session_id, call.seq, call.committed_length, _retry_block(call))
        self._timers.at(time.monotonic() + timeout, lambda: self._timed_out(call, attempt, backend, timeout))
        inner.add_done_callback(lambda f: self._inner_done(call, attempt, backend, f))

    def _take(self, call: _Call, attempt: int) -> bool:
        """Claim the outcome of ``attempt`` (False: the call moved on, or the outcome was taken already)."""
        with call.lock:
            if call.future.done() or attempt != call.attempt or call.handled >= attempt:
                return False
            call.handled = attempt
            return True

    def _inner_done(self, call: _Call, attempt: int, backend: VerifierBackend, inner: Future) -> None:
        if not self._take(call, attempt):
            return  # a late verdict of an abandoned attempt: never counted or streamed
        exc = inner.exception()
        if exc is None:
            self._resolve(call, inner.result())
        elif is_retryable(exc):
            self._pool.submit(self._failed, call, attempt, backend, exc)  # not on the stream's reader thread
        elif isinstance(exc, (InvalidRequestError, PreconditionError)) and call.failures:
            self._pool.submit(self._reconcile, call, backend, exc)
        else:
            self._fail(call, exc)

    def _timed_out(self, call: _Call, attempt: int, backend: VerifierBackend, timeout_s: float) -> None:
        if self._take(call, attempt):
            where = backend.address if isinstance(backend, Addressed) else "?"
            err = DeadlineError(f"no verdict from {where} within {timeout_s:.1f} s")
            self._pool.submit(self._failed, call, attempt, backend, err)

    def _failed(self, call: _Call, attempt: int, backend: VerifierBackend | None, err: BaseException,
                drop: bool = True) -> None:
        """A retryable failure of an attempt: give the connection up, back off, retry (or give up)."""
        if drop:
            self._conns.drop(backend)
        now = time.monotonic()
        with call.lock:
            call.failures += 1
            call.last_error = err
            if call.first_failure_at is None:
                call.first_failure_at = now
                call.deadline = now + self.policy.budget_s
            failures, first = call.failures, call.first_failure_at
        if self._conns.closed:
            self._fail(call, VerifierUnavailableError("verifier backend is closed"))
            return
        if failures >= self.policy.max_attempts or now > call.deadline:
            self._fail(call, exhausted_error(f"block seq {call.seq} of session {call.session_id}", failures,
                                             now - first, err))
            return
        delay = self.policy.backoff_s(failures - 1, self._rng)
        log.info("verify of session %s seq %d failed (%s); retrying in %.0f ms", call.session_id, call.seq, err,
                 delay * 1000)
        self._timers.at(now + delay, lambda: self._pool.submit(self._attempt, call))

    def _reconcile(self, call: _Call, backend: VerifierBackend, err: SpecdecError) -> None:
        """A retried block was refused: committed already by the replica that failed, or by the first attempt
        whose verdict was lost (a committed-length mismatch; FAILED_PRECONDITION when that block finished the
        session): the verdict is rebuilt from the store. Refused for another reason: raise it (a block still in
        flight there: retry)."""
        try:
            info = backend.get_session(call.session_id)
        except SpecdecError as e:
            if is_retryable(e):
                self._failed(call, call.attempt, backend, e)
            else:
                self._fail(call, e)
            return
        ids = list(info.committed_token_ids)
        if len(ids) > call.committed_length:
            from specdec_runtime.common.wire import finish_reason_from_proto, session_logprobs

            try:
                verdict = verdict_from_store(call.block.draft_token_ids, call.committed_length, ids, info.finished,
                                             finish_reason_from_proto(info.finish_reason), call.seq)
                verdict.logprobs = session_logprobs(info, call.committed_length, len(ids))  # None unless asked
            except InvalidRequestError as e:
                self._fail(call, e)
                return
            log.info("session %s seq %d: committed before the failure; verdict rebuilt from the store",
                     call.session_id, call.seq)
            self._resolve(call, verdict)
        elif len(ids) == call.committed_length and "in flight" in str(err):
            self._failed(call, call.attempt, backend, VerifierUnavailableError(str(err)), drop=False)
        else:
            self._fail(call, err)

    def _resolve(self, call: _Call, verdict: Verdict) -> None:
        if call.failures:
            with self._lock:
                self.num_failovers += 1
                now = time.monotonic()
                if call.first_failure_at is not None:
                    self.last_failover_ms.append((now - call.first_failure_at) * 1000)
                    self.last_retry_ms.append((now - call.attempt_started_at) * 1000)
        if not call.future.done():
            call.future.set_result(verdict)

    @staticmethod
    def _fail(call: _Call, err: BaseException) -> None:
        if not call.future.done():
            call.future.set_exception(err)

    def close(self) -> None:
        """Close the connection and the retry machinery; pending calls fail with VerifierUnavailableError."""
        if not self._conns.close():
            return
        self._timers.close()
        self._pool.shutdown(wait=False)
