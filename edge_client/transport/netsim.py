"""Simulated network delay for the edge client (test proactive drafting and adaptive γ without a real WAN)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from specdec_runtime.common.types import ExtendRequest, OpenRequest, SessionOpened
from specdec_runtime.edge_client.stats import WireStats
from specdec_runtime.edge_client.transport.backend import (CountsWire, VerifierBackend, answers, failovers_of,
                                                           max_call_s_of)


class DelayedBackend(VerifierBackend):
    """Wraps a backend, adding a fixed one-way delay to every request (uplink) and response (downlink).

    Args:
        inner: the real backend.
        uplink_ms: edge → verifier delay per message, ms.
        downlink_ms: verifier → edge delay per message, ms (default: same as uplink).
    """

    def __init__(self, inner: VerifierBackend, uplink_ms: float, downlink_ms: float | None = None):
        if uplink_ms < 0 or (downlink_ms is not None and downlink_ms < 0):
            raise ValueError("network delays must be >= 0 ms")
        self.inner = inner
        self.uplink_s = uplink_ms / 1000.0
        self.downlink_s = (uplink_ms if downlink_ms is None else downlink_ms) / 1000.0

    # what the edge reads of the backend besides its calls, passed on explicitly; cloud decode is not (no
    # ``decode``/``connection``): over the simulated network it goes one block per token, each through the delays
    @property
    def max_call_s(self) -> float:
        """The inner backend's ``max_call_s`` (its retries), 0.0 when it has none, s."""
        return max_call_s_of(self.inner)

    @property
    def num_failovers(self) -> int:
        """The inner backend's failover count (0 when it counts none)."""
        return failovers_of(self.inner)

    def wire_stats(self, session_id: str) -> WireStats:
        """The inner backend's counts for ``session_id`` (zeros when it counts none)."""
        return self.inner.wire_stats(session_id) if isinstance(self.inner, CountsWire) else WireStats()

    def probe(self, timeout_s: float = 2.0) -> bool:
        """Whether the cloud behind the inner backend answers (:func:`edge_client.transport.backend.answers`)."""
        return answers(self.inner, timeout_s)

    def open_session(self, request: OpenRequest, timeout_s: float | None = None) -> SessionOpened:
        """The inner backend's OpenSession behind one uplink and one downlink delay."""
        time.sleep(self.uplink_s)
        try:
            return self.inner.open_session(request, timeout_s=timeout_s)
        finally:
            time.sleep(self.downlink_s)

    def extend_session(self, request: ExtendRequest, timeout_s: float | None = None) -> SessionOpened:
        """The inner backend's ExtendSession behind the same delays as :meth:`open_session`."""
        time.sleep(self.uplink_s)
        try:
            return self.inner.extend_session(request, timeout_s=timeout_s)
        finally:
            time.sleep(self.downlink_s)

    def submit(self, session_id, seq, committed_length, block) -> Future:
        out: Future = Future()

        def deliver(inner_future: Future) -> None:
            def finish():
                exc = inner_future.exception()
                if exc is not None:
                    out.set_exception(exc)
                else:
                    out.set_result(inner_future.result())

            timer = threading.Timer(self.downlink_s, finish)
            timer.daemon = True
            timer.start()

        def send():
            try:
                self.inner.submit(session_id, seq, committed_length, block).add_done_callback(deliver)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out.set_exception(e)

        timer = threading.Timer(self.uplink_s, send)
        timer.daemon = True
        timer.start()
        return out

    def close_session(self, session_id: str) -> None:
        self.inner.close_session(session_id)

    def close(self) -> None:
        self.inner.close()
