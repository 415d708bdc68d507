"""A decision over the acceptance ledger taken at most once per interval (the canary judge, the watchdog): both
run in the verifier's background loop and from the delivery path (ResolveDraft), so a check that fails is logged
and waits for the next one instead of failing a device's request, and one check runs at a time."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

__all__ = ["PeriodicCheck"]


class PeriodicCheck:
    """Base of a check run by :meth:`maybe_check` at most once per ``check_interval_s`` (s); subclasses define
    :meth:`check` (returns the decisions taken, ``(name@version, decision)``) and ``what`` (for the log)."""

    what = "draft check"

    def __init__(self, check_interval_s: float):
        self.check_interval_s = check_interval_s
        self._next = 0.0
        self._running = threading.Lock()

    def check(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def maybe_check(self) -> list[tuple[str, str]]:
        """:meth:`check`, at most once per ``check_interval_s`` and one at a time (a call while another runs
        returns at once); never raises (a failed check is logged)."""
        if not self._running.acquire(blocking=False):
            return []
        try:
            now = time.monotonic()
            if now < self._next:
                return []
            self._next = now + self.check_interval_s
            return self.check()
        except Exception as e:  # noqa: BLE001 - the decision waits for the next check; delivery goes on
            log.warning("%s failed: %s", self.what, e)
            return []
        finally:
            self._running.release()
