"""One ``Verify`` call (bidi stream, blocks of any sessions): blocks in, verdicts out in block order.

:class:`VerifyStream` holds the three parts of one call:

- the **reader** (:meth:`VerifyStream.read`): each block read from the stream is converted
  (:func:`common.wire.block_from_proto`) and handed to the verifier at once as a task, so blocks of different
  sessions on one stream are batched together; blocks of one session run one after the other, each waiting for
  the one before it;
- the **in-flight bookkeeping**: the last task of each session (forgotten once answered, so a stream that lives
  for many sessions keeps nothing per finished session), the stream's unanswered tasks (cancelled when the
  stream ends early), and the stream index of the first failed block: blocks after it are not verified
  (:class:`Skipped`, never sent to the client);
- the **verdict writer** (:meth:`VerifyStream.verdicts`): waits for the tasks in stream order and yields their
  verdicts; a failed block ends the stream with its status after the verdicts of the blocks before it.

Draining (graceful shutdown): new blocks are answered UNAVAILABLE; blocks already read are answered first.
A stream that ends early (cancelled by the client, broken, or failed): its blocks still queued are dropped
(nothing committed) and those in a forward pass end committed wholly (the batcher), so the sessions are free for
the client's next stream, on this replica or another.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from specdec_runtime.common.errors import SpecdecError, VerifierUnavailableError
from specdec_runtime.common.types import Verdict
from specdec_runtime.common.wire import BlockRequest, block_from_proto, verdict_to_proto
from specdec_runtime.common.v1 import verifier_pb2 as pb

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.verifier import Verifier

STREAM_WINDOW = 64  # blocks read ahead on one Verify stream before back-pressure (HTTP/2 flow control)

_NO_FAILURE = float("inf")  # _failed_at while every block so far was verified
_STREAM_OVER = -1  # _failed_at once the stream is over: below every index, so nothing more is verified
_AGAIN = object()  # the writer's wait ended by the drain, not by an item: look again


class Skipped(VerifierUnavailableError):
    """A block not verified because an earlier block of its stream failed (never sent to the client)."""


def _forget_last(last_of_session: dict, session_id: str, task: asyncio.Task) -> None:
    """Done callback of a block task: drop it from ``last_of_session`` if it is still there."""
    if last_of_session.get(session_id) is task:
        del last_of_session[session_id]


class VerifyStream:
    """The state of one ``Verify`` call (see the module docstring).

    Args:
        verifier: verifies each block (``Verifier.verify``).
        drain: set when the replica shuts down (the servicer's).
        track: called with every block task once created (the servicer keeps tasks that outlive an aborted
            stream, and retrieves their exceptions).
        tenant_kw: ``{"tenant_id": ...}`` of the whole stream (cloud_verifier.security.auth), or {}.
    """

    def __init__(self, verifier: "Verifier", drain: asyncio.Event, track: Callable[[asyncio.Task], None],
                 tenant_kw: dict[str, str]):
        self.verifier = verifier
        self._drain = drain
        self._track = track
        self._tenant_kw = tenant_kw
        # Task (a block's verdict) | SpecdecError | Exception (the stream broke) | None (= end of the stream)
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_WINDOW)
        self._last_of_session: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()  # this stream's blocks not answered yet
        self._failed_at = _NO_FAILURE  # stream index of the first failed block
        self._count = 0  # blocks read
        self._get: asyncio.Future | None = None  # the writer's pending queue.get() (cancelled with the stream)
        self._drain_wait: asyncio.Future | None = None

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    # ------------------------------------------------------------------ reader, bookkeeping
    async def read(self, request_iterator: AsyncIterator[pb.DraftBlock]) -> None:
        """Read blocks until the stream ends, starting one task per block; queue each task, then None (end), or
        the error that ends the stream (a malformed block, draining, or the stream broken)."""
        try:
            async for msg in request_iterator:
                if self.draining:
                    await self._queue.put(VerifierUnavailableError("verifier is shutting down"))
                    return
                try:
                    request = block_from_proto(msg)
                except SpecdecError as err:
                    await self._queue.put(err)
                    return
                await self._queue.put(self._start(request))
            await self._queue.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the stream broke (client gone): end the handler
            await self._queue.put(err)

    def _start(self, request: BlockRequest) -> asyncio.Task:
        """The task verifying ``request``, after the session's previous block of this stream."""
        self._count += 1
        sid = request.session_id
        task = asyncio.create_task(self._run_block(self._count, self._last_of_session.get(sid), request))
        self._last_of_session[sid] = task
        # forgotten once answered, unless a later block of the session took its place
        task.add_done_callback(functools.partial(_forget_last, self._last_of_session, sid))
        self._track(task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run_block(self, index: int, prev: asyncio.Task | None, request: BlockRequest) -> Verdict:
        if prev is not None and not prev.done():
            await asyncio.wait([prev])  # one block of a session at a time, in stream order
        if self._failed_at < index:  # an earlier block failed: the stream ends, later ones are not verified
            raise Skipped()
        try:
            return await self.verifier.verify(request.session_id, request.seq, request.committed_length,
                                              request.block, **self._tenant_kw)
        except BaseException:
            # Set synchronously: the verifier validates a block before its first suspension, so a block
            # failing validation is seen by every block created after it (asyncio runs tasks FIFO).
            self._failed_at = min(self._failed_at, index)
            raise

    def _abandon(self) -> None:
        """The stream is over: verify nothing more, cancel its unanswered blocks."""
        self._failed_at = _STREAM_OVER
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------------ writer
    async def verdicts(self, request_iterator: AsyncIterator[pb.DraftBlock]) -> AsyncIterator[pb.Verdict]:
        """The stream's verdicts in block order (runs :meth:`read` meanwhile).

        Raises:
            SpecdecError: the status the stream ends with (the first failed block's, or UNAVAILABLE when the
                replica drains).
        """
        reader = asyncio.create_task(self.read(request_iterator))
        try:
            while True:
                item = await self._next_item(reader)
                if item is _AGAIN:
                    continue  # draining: loop to answer what is queued, then end
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                verdict = await item
                yield verdict_to_proto(verdict, verdict.seq)
        except BaseException:
            # cancelled by the client, broken, or failed: its blocks still queued are dropped (nothing committed)
            # and those in a forward pass end committed wholly (Batcher)
            self._abandon()
            raise
        finally:
            reader.cancel()
            if self._drain_wait is not None:
                self._drain_wait.cancel()
            if self._get is not None and not self._get.done():
                self._get.cancel()

    async def _next_item(self, reader: asyncio.Task) -> Any:
        """The next queued item, waiting for one unless the replica drains (then :data:`_AGAIN`).

        Raises:
            VerifierUnavailableError: draining, nothing queued and the reader still running.
        """
        if not self._queue.empty():
            return self._queue.get_nowait()
        if self.draining and not reader.done():
            raise VerifierUnavailableError("verifier is shutting down")
        self._get = get = asyncio.ensure_future(self._queue.get())
        if self._drain_wait is None:
            self._drain_wait = asyncio.ensure_future(self._drain.wait())
        await asyncio.wait({get, self._drain_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            return _AGAIN
        return get.result()
