"""The draft's prefill in a thread of its own, while cloud decode streams the first tokens (``route="cloud-first"``,
and ``auto``'s start: :mod:`edge_client.generation.routing`, docs/routing.md "cloud-first").

:class:`DraftPrefill` feeds the draft the context it has not seen — the prompt, then the tokens cloud decode
commits meanwhile (it reads the generation's committed list, which only grows) — one chunk per forward pass
(:meth:`edge_client.drafting.drafter.ModelDrafter.prefill_step`, at most PREFILL_CHUNK_TOKENS each), until it is caught
up: then it is *ready* and its thread ends. Between chunks it checks for a stop, so stopping it (a switch, the
session's end, a failure) waits for one chunk's forward pass at most, however long the prompt.

Ownership: while the thread runs, it alone touches the drafter (the ONNX draft is not thread-safe); the loop
calls :meth:`DraftPrefill.stop` before any other use of the drafter (drafting, device fallback). What the loop
reads meanwhile (``ready``, ``num_unseen``) are plain values the thread publishes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from specdec_runtime.edge_client.drafting.contract import PrefillsConcurrently

__all__ = ["DraftPrefill", "can_prefill"]


def can_prefill(drafter) -> bool:
    """True when ``drafter`` has a KV cache to prefill concurrently
    (:class:`edge_client.drafting.contract.PrefillsConcurrently`: ModelDrafter); n-gram drafting and target-only
    decoding have nothing to prefill."""
    return isinstance(drafter, PrefillsConcurrently)


class DraftPrefill:
    """Prefill ``drafter`` with ``committed`` (the generation's committed ids: read, never written) in a
    daemon thread, started at once or by :meth:`start`.

    Args:
        drafter: a drafter with ``prefill_step`` (:func:`can_prefill`).
        committed: the list the generation appends committed tokens to.
        whole_chunks: feed only whole chunks (a seeded sampled generation: the KV must not depend on when the
            thread ran; the rest is fed by the first block, as from scratch).
        start: start the thread now; False: at :meth:`start` (cloud-first starts it once the Decode request is
            on its way, so the draft's first forward pass does not delay the request on the device's CPU).

    Attributes:
        ready_s: seconds from the start until the thread was caught up (None until then, or when stopped first).
        num_fed, fed_s: tokens fed and the seconds spent feeding them (the draft's prefill cost on this device).
        error: what the thread raised, if anything (re-raised by :meth:`stop`).
        on_ready: called in the thread, once, the moment it is caught up (set it before :meth:`start`): the
            hand-over need not wait for the next cloud token; what it raises is the thread's ``error``.
    """

    def __init__(self, drafter, committed: Sequence[int], whole_chunks: bool = False, start: bool = True):
        self._drafter, self._committed, self._whole = drafter, committed, bool(whole_chunks)
        self._stopping = threading.Event()
        self.t0 = time.perf_counter()
        self.ready_s: float | None = None
        self.num_fed, self.fed_s = 0, 0.0
        self._seen = 0  # tokens of ``committed`` whose KV the draft holds (published after each chunk)
        self.error: BaseException | None = None
        self.on_ready: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="draft-prefill", daemon=True)
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        """Start the thread (once; later calls do nothing; ``ready_s`` still counts from the construction)."""
        if not self._started and not self._stopping.is_set():
            self._started = True
            self._thread.start()

    @property
    def ready(self) -> bool:
        """The draft has caught up with everything committed when it last looked (its thread has ended)."""
        return self.ready_s is not None

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until the thread has ended (caught up, stopped or failed), at most ``timeout_s`` (None: no limit);
        True when ready."""
        if self._started:
            self._thread.join(timeout_s)
        return self.ready

    def num_unseen(self) -> int:
        """Tokens committed so far that the draft has not ingested yet (beyond the last one, which every block
        feeds): its catch-up left."""
        return max(0, len(self._committed) - 1 - self._seen)

    def remaining_s(self, fallback_s_per_token: float | None) -> float | None:
        """Expected seconds until ready: the unseen tokens at this prefill's own rate so far (else at
        ``fallback_s_per_token``; None when neither is known)."""
        if self.ready:
            return 0.0
        rate = self.fed_s / self.num_fed if self.num_fed else fallback_s_per_token
        return None if rate is None else self.num_unseen() * rate

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                ids = list(self._committed)  # a snapshot: the loop appends to the list meanwhile
                t0 = time.perf_counter()
                n = self._drafter.prefill_step(ids, self._whole)
                if n == 0:
                    self._seen = len(ids) - 1
                    self.ready_s = time.perf_counter() - self.t0
                    if self.on_ready is not None:
                        self.on_ready()
                    return
                self.num_fed, self.fed_s = self.num_fed + n, self.fed_s + time.perf_counter() - t0
                self._seen = len(ids) - 1 - self._drafter.uncached(ids)
        except BaseException as e:  # noqa: BLE001 - handed to the loop by stop()
            self.error = e

    def stop(self) -> None:
        """Stop the thread after its current chunk and wait for it; the drafter is the caller's again.

        Raises:
            whatever the prefill raised (e.g. the draft's context is too short for the prompt: ValueError)."""
        self._stopping.set()
        if self._started:
            self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
