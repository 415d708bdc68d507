"""The client side of the bidi ``Verify`` call of a :class:`~edge_client.transport.grpc_backend.GrpcBackend` (``mode="stream"``).

One long-lived call per backend: a request queue feeds the stream, a reader thread resolves the blocks' futures
in order (verdicts come back in block order; each is checked against its block's seq). When the server ends the
stream because of one block, that block's future gets the error and the blocks sent after it (which the server
did not verify) are resent once on a new stream; connection-level failures (UNAVAILABLE, ...) fail every
pending block.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Iterator, Protocol

import grpc

from specdec_runtime.common.errors import SpecdecError, VerifierUnavailableError
from specdec_runtime.common.wire import verdict_from_proto
from specdec_runtime.common.v1 import verifier_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["Pending", "StreamOwner", "VerifyCall"]


class Pending:
    """A block sent and not yet answered."""

    __slots__ = ("future", "request", "session_id", "seq", "committed_length", "draft_token_ids", "resent")

    def __init__(self, future: Future, request: pb.DraftBlock, committed_length: int, draft_token_ids: list[int]):
        self.future = future
        self.request = request
        self.session_id = request.session_id
        self.seq = request.seq
        self.committed_length = committed_length
        self.draft_token_ids = draft_token_ids
        self.resent = False


# Stream statuses that concern the connection, not one block: every pending block fails with them.
_CONNECTION_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.UNKNOWN}

_END = object()


class StreamOwner(Protocol):
    """What a :class:`VerifyCall` needs of the backend that owns it (GrpcBackend implements it)."""

    address: str

    @property
    def closed(self) -> bool: ...

    def start_verify_call(self, requests: Iterator[pb.DraftBlock]): ...

    def count_received(self, session_id: str, nbytes: int) -> None: ...

    def map_error(self, err: grpc.RpcError) -> SpecdecError: ...

    def resend(self, p: Pending) -> None: ...


class VerifyCall:
    """One bidi Verify call: requests from a queue, verdicts matched to pending blocks in order."""

    def __init__(self, backend: StreamOwner):
        self.backend = backend
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: collections.deque[Pending] = collections.deque()
        self.lock = threading.Lock()
        self.dead = False
        self.call = backend.start_verify_call(self._iter_requests())
        self.reader = threading.Thread(target=self._read, name="specdec-verify-reader", daemon=True)
        self.reader.start()

    def _iter_requests(self):
        while True:
            item = self.requests.get()
            if item is _END:
                return
            yield item

    def send(self, pending: Pending) -> bool:
        """Queue a block; False when the stream is dead (the caller opens a new one)."""
        with self.lock:
            if self.dead:
                return False
            self.pending.append(pending)
            self.requests.put(pending.request)
            return True

    def _read(self) -> None:
        error: SpecdecError | None = None
        block_error = False  # the server ended the stream because of the first pending block
        try:
            for msg in self.call:
                with self.lock:
                    p = self.pending.popleft() if self.pending else None
                if p is None:
                    log.error("verdict seq %d with no pending block: dropping the stream", msg.seq)
                    error = VerifierUnavailableError("protocol error: verdict without a block")
                    break
                self.backend.count_received(p.session_id, msg.ByteSize())
                if msg.seq != p.seq:
                    p.future.set_exception(VerifierUnavailableError(
                        f"protocol error: verdict seq {msg.seq} for block seq {p.seq} of session {p.session_id}"
                    ))
                    error = VerifierUnavailableError("protocol error: verdicts out of order")
                    break
                try:
                    p.future.set_result(verdict_from_proto(msg, p.draft_token_ids, p.committed_length))
                except SpecdecError as e:
                    p.future.set_exception(e)
        except grpc.RpcError as e:
            error = self.backend.map_error(e)
            block_error = e.code() not in _CONNECTION_CODES
        except Exception as e:  # noqa: BLE001 - never leave futures hanging
            log.exception("verify stream reader failed")
            error = VerifierUnavailableError(f"verify stream failed: {e}")
        with self.lock:
            self.dead = True
            pending, self.pending = list(self.pending), collections.deque()
        self.requests.put(_END)  # release grpc's request-consuming thread
        if error is None:
            error = VerifierUnavailableError(f"verify stream to {self.backend.address} ended")
        if block_error and pending:
            # The server answers in order and verifies nothing after a failed block: the first pending block
            # failed; the later ones were not verified and go again on a new stream (once).
            first, rest = pending[0], pending[1:]
            first.future.set_exception(error)
            for p in rest:
                if p.resent or self.backend.closed:
                    p.future.set_exception(error)
                else:
                    p.resent = True
                    self.backend.resend(p)
            return
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def close(self) -> None:
        with self.lock:
            self.dead = True
        self.requests.put(_END)
        self.call.cancel()
        self.reader.join(timeout=5.0)
