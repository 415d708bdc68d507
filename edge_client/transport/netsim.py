"""Simulated network delay for the edge client (test proactive drafting and adaptive γ without a real WAN)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from specdec_runtime.edge_client.transport.backend import VerifierBackend


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

    def __getattr__(self, name):  # wire_stats, verifier, ... of the inner backend
        return getattr(self.inner, name)

    def open_session(self, *args, **kwargs):
        time.sleep(self.uplink_s)
        try:
            return self.inner.open_session(*args, **kwargs)
        finally:
            time.sleep(self.downlink_s)

    def extend_session(self, *args, **kwargs):
        """The inner backend's ExtendSession behind the same delays as :meth:`open_session`."""
        time.sleep(self.uplink_s)
        try:
            return self.inner.extend_session(*args, **kwargs)
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
