"""How a failed call to a verifier is retried: the policy (:class:`RetryPolicy`: attempts, jittered exponential
backoff, budget, deadlines), which failures are retried (:func:`is_retryable`), the error when the budget is
spent, and the timer thread that runs attempt deadlines and backoff waits (:class:`Timers`). Used by
:class:`edge_client.transport.failover.FailoverBackend`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specdec_runtime.common.errors import DeadlineError, VerifierUnavailableError

log = logging.getLogger(__name__)

__all__ = ["RetryPolicy", "Timers", "exhausted_error", "is_retryable"]


@dataclass(frozen=True)
class RetryPolicy:
    """How a failed call is retried.

    Attributes:
        max_attempts: tries of one call, the first one included (>= 1).
        initial_backoff_s: backoff cap before the first retry, s; the cap grows by ``multiplier`` per retry up
            to ``max_backoff_s``; the wait is uniform in [0, cap] ("full jitter").
        max_backoff_s: largest backoff cap, s.
        multiplier: growth of the backoff cap per retry (>= 1).
        budget_s: wall time a call may go on retrying after its first failure, s (the retry budget, with
            ``max_attempts``).
        attempt_timeout_s: a verify attempt without a verdict for this long failed (DEADLINE_EXCEEDED), s.
        connect_timeout_s: connecting to one address, s.

    Raises:
        ValueError: from :meth:`validate` on a value out of range.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    budget_s: float = 30.0
    attempt_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0

    def validate(self) -> None:
        """Raise ValueError when a field is out of range."""
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        for name in ("initial_backoff_s", "max_backoff_s", "budget_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("attempt_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number ``retry`` (0 = the first retry), s: uniform in [0, min(max_backoff_s,
        initial_backoff_s × multiplier^retry)]."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, retry))
        return rng.uniform(0.0, cap)

    @property
    def max_call_s(self) -> float:
        """Longest a call can take, retries included, s (a caller's own deadline should not be shorter)."""
        return self.attempt_timeout_s + self.budget_s + self.max_backoff_s + self.connect_timeout_s


def is_retryable(err: BaseException) -> bool:
    """A failure of the path to the verifier, not an answer about the request: UNAVAILABLE (a replica down,
    draining, or a broken/reset stream, see :func:`edge_client.transport.errors.is_broken_stream`) and
    DEADLINE_EXCEEDED."""
    return isinstance(err, (VerifierUnavailableError, DeadlineError))


def exhausted_error(what: str, failures: int, elapsed_s: float,
                    last: BaseException | None) -> VerifierUnavailableError:
    """The error of a call (``what``, logged) that spent its retry budget: ``failures`` attempts in ``elapsed_s``
    s. Its message is what the user reads (docs/failover.md): ``cannot reach verifier at ADDRESS: why``."""
    log.info("%s: no verifier answered after %d failed attempts in %.1f s (last: %s)", what, failures, elapsed_s,
             last)
    reason = str(last) if last is not None else "no answer"
    head = reason if reason.startswith("cannot reach verifier") else f"cannot reach verifier: {reason}"
    return VerifierUnavailableError(f"{head} (gave up after {failures} attempts in {elapsed_s:.1f} s)")


class Timers:
    """One thread running callbacks at deadlines (attempt timeouts, backoff waits); cheap per call."""

    def __init__(self) -> None:
        self._heap: list = []
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="specdec-failover-timers", daemon=True)
        self._thread.start()

    def at(self, deadline: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` (quick, non-blocking) at ``time.monotonic()`` ``deadline``."""
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._ids), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(timeout)
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("failover timer callback failed")

    def close(self) -> None:
        """Stop the thread (callbacks not yet due never run)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
