"""An embedded verifier: the cloud side run inside the edge's process, for ``specdec generate`` without
``--server``, benchmarks and tests.

- :class:`EmbeddedServer`: a real gRPC verifier server on 127.0.0.1 (free port) in a background thread; the edge
  reaches it through :class:`edge_client.transport.grpc_backend.GrpcBackend` exactly as it reaches a remote one.
- :class:`LocalBackend`: direct calls into an in-process :class:`cloud_verifier.verifier.Verifier` (no network),
  the bare loop for ``--in-process`` and benchmarks.

This is wiring of the two sides, so it lives in the tooling layer: ``edge_client`` and ``cloud_verifier`` never
import each other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from specdec_runtime.cloud_verifier.serving.server import VerifierServer
from specdec_runtime.common.types import ExtendRequest, OpenRequest, SessionOpened
from specdec_runtime.edge_client.transport.backend import VerifierBackend

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.config import VerifierSettings
    from specdec_runtime.cloud_verifier.verifier import Verifier

log = logging.getLogger(__name__)


class EmbeddedServer:
    """A verifier gRPC server on 127.0.0.1 (free port) in a background thread with its own event loop.

    ``verifier``: serve this verifier (not freed on stop); None = ``Verifier.from_settings(settings)``
    (default settings), freed on stop. ``grace_s``: shutdown grace period, s. ``security``: TLS credentials and
    API keys of the port (:class:`cloud_verifier.security.transport.ServerSecurity`; None = plaintext, no authentication).
    ``drafts``: the drafts it delivers (:class:`cloud_verifier.drafts.catalog.DraftCatalog`; None = none).

    Usage::

        with EmbeddedServer(verifier=v) as address:   # "127.0.0.1:PORT"
            backend = GrpcBackend(address)
    """

    def __init__(self, verifier: "Verifier | None" = None, settings: "VerifierSettings | None" = None, *,
                 host: str = "127.0.0.1", grace_s: float = 5.0, security=None, drafts=None):
        self.security = security
        self.drafts = drafts
        self.verifier = verifier
        self.settings = settings
        self.host = host
        self.grace_s = grace_s
        self.address: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._server: VerifierServer | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout_s: float | None = None, *, progress: Callable[[float], None] | None = None,
              progress_every_s: float = 5.0) -> str:
        """Start serving; returns "127.0.0.1:PORT" once the server answers RPCs (health tells whether the verifier
        can take a session). Waits as long as the start takes: its end (ready, or failed) is what is waited for,
        not a fixed time, so a loaded machine starts late instead of failing. ``timeout_s``: a bound all the same
        (None: none); ``progress(elapsed_s)``: called every ``progress_every_s`` s while it waits (a CLI's
        "still starting" line).

        Raises:
            the start's own error (e.g. RuntimeError: the address cannot be bound);
            common.errors.VerifierUnavailableError: the server thread ended without starting, or ``timeout_s``
                passed (the start is abandoned).
        """
        if self._thread is not None:
            return self.address
        owns = self.verifier is None
        if owns:
            from specdec_runtime.cloud_verifier.config import VerifierSettings
            from specdec_runtime.cloud_verifier.verifier import Verifier

            self.verifier = Verifier.from_settings(self.settings or VerifierSettings(metrics_port=0))
        self._thread = threading.Thread(target=self._run, args=(owns,), name="specdec-embedded-verifier",
                                        daemon=True)
        self._thread.start()
        self._wait_started(timeout_s, progress, progress_every_s)
        if self._error is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
            raise self._error
        return self.address

    def _wait_started(self, timeout_s: float | None, progress, progress_every_s: float) -> None:
        """Until the server thread says it started or failed (or ended, or ``timeout_s`` passed: raised)."""
        from specdec_runtime.common.errors import VerifierUnavailableError

        begin = time.monotonic()
        next_progress = begin + progress_every_s
        while not self._started.wait(0.2):
            now = time.monotonic()
            if not self._thread.is_alive():
                self._thread = None
                raise VerifierUnavailableError("the embedded verifier stopped before it started serving")
            if timeout_s is not None and now - begin > timeout_s:
                self.stop(timeout_s=5.0)
                raise VerifierUnavailableError(f"the embedded verifier did not start within {timeout_s:g} s")
            if progress is not None and now >= next_progress:
                progress(now - begin)
                next_progress = now + progress_every_s

    def _run(self, owns: bool) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            self._server = VerifierServer(self.verifier, host=self.host, port=0, grace_s=self.grace_s,
                                          owns_verifier=owns, security=self.security, drafts=self.drafts)
            try:
                await self._server.start()
            except BaseException as e:
                self._error = e
                self._started.set()
                return
            self.address = self._server.address
            self._started.set()
            await self._stop_event.wait()
            await self._server.stop()

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start() or logged
            if not self._started.is_set():
                self._error = e
                self._started.set()
            else:
                log.exception("embedded verifier failed")

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful stop (in-flight blocks finish); waits up to ``timeout_s`` s (default grace + 10 s)."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None and self._stop_event is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:  # loop already closed
                pass
        thread.join(timeout=self.grace_s + 10.0 if timeout_s is None else timeout_s)
        if thread.is_alive():
            log.warning("embedded verifier did not stop in time")
        self._thread = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalBackend(VerifierBackend):
    """Direct calls into an in-process :class:`cloud_verifier.verifier.Verifier` (no network).

    The verifier's batcher runs on an asyncio loop in a background thread, as it would inside the server.
    """

    def __init__(self, verifier, start_timeout_s: float | None = None):
        """Start ``verifier`` on the backend's loop, waiting for its start to end (``start_timeout_s``: a bound
        all the same, s; None: none, so a loaded machine starts late instead of failing)."""
        self.verifier = verifier
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specdec-local-verifier", daemon=True)
        self._thread.start()
        self._call(verifier.start(), start_timeout_s)

    def _call(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def open_session(self, request: OpenRequest, timeout_s: float | None = None) -> SessionOpened:
        """The verifier's OpenSession with ``request``, waiting at most ``timeout_s`` s (None: no bound)."""
        return self._call(
            self.verifier.open_session(request.prompt_token_ids, request.sampling, request.stopping,
                                       request.tokenizer_fingerprint, num_output_tokens=request.num_output_tokens,
                                       draft_name=request.draft_name, draft_version=request.draft_version,
                                       features=request.features),
            timeout_s)

    def extend_session(self, request: ExtendRequest, timeout_s: float | None = None) -> SessionOpened:
        """The verifier's ExtendSession with ``request``, waiting at most ``timeout_s`` s (None: no bound)."""
        return self._call(
            self.verifier.extend_session(request.session_id, request.committed_length, request.appended_token_ids,
                                         request.sampling, request.stopping, features=request.features,
                                         features_from=request.features_from),
            timeout_s)

    def submit(self, session_id, seq, committed_length, block):
        return asyncio.run_coroutine_threadsafe(
            self.verifier.verify(session_id, seq, committed_length, block), self._loop
        )

    def close_session(self, session_id: str) -> None:
        self.verifier.close_session(session_id)

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            self._call(self.verifier.stop(grace_s=5.0), 10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
