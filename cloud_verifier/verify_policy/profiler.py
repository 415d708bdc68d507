"""The cost model of adaptive verification, filled without holding the verifier up: a verifier serves as soon as
its target is loaded.

1. **Prior**, when the verifier starts: the last cost table saved for this target and device
   (:mod:`~cloud_verifier.verify_policy.cost_table`), read in milliseconds; else one **probe** pass of
   :data:`PROBE_SHAPE` (two forward passes of a few tokens: it also pays the target's first-call costs before
   the first session does). One probe is a single point: the adaptive policy verifies whole blocks (what the
   fixed policy does) until the first live step gives the model a second one.
2. **Background profile**, when there was no saved table: the shapes of
   :data:`~cloud_verifier.verify_policy.cost.PROFILE_SHAPES`, one at a time, on the target's thread between
   batch steps and only once the verifier has been idle for ``quiet_s`` s (no work; the verifier adds: no session
   held, since a held session may send its next block at any moment); a shape gives way (is measured again
   later) as soon as that changes between two of its passes, so a new session waits at most one profile pass.
   A verifier that always holds sessions is not profiled in the background: its live steps, of many shapes as
   the load varies, refine the prior instead.
   Once every shape is measured (or left out: the KV pool cannot hold it) the table is saved for the next start.
3. **Live steps** refine the model all along (:meth:`~cloud_verifier.verify_policy.cost.ForwardCostModel.observe`).

None of this changes a token: the cost model only decides how many positions of a block a step verifies, and
every choice is lossless (:mod:`~cloud_verifier.verify_policy.policy`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable, ContextManager

from specdec_runtime.cloud_verifier.verify_policy.cost import PROFILE_SHAPES, ForwardCostModel, measure_shape
from specdec_runtime.cloud_verifier.verify_policy.cost_table import CostTableCache

__all__ = ["PROBE_SHAPE", "QUIET_S", "CostProfiler"]

log = logging.getLogger(__name__)

PROBE_SHAPE = (1, 8)  # (rows, tokens per row) of the start-up probe: a short decode-like pass
# the verifier must have been idle this long before a profile pass runs, s; SPECDEC_PROFILE_QUIET_S=inf turns the
# background profile off (the test suite does: a pass in an idle second would land between a test's steps)
QUIET_S = float(os.environ.get("SPECDEC_PROFILE_QUIET_S", "1.0"))
_MAX_TRIES = 20  # a shape the pool is too short for this many times is left out of the table


class CostProfiler:
    """Fills ``cost`` (this module's docstring) for a verifier's batcher.

    Args:
        runner: the target runner (:class:`cloud_verifier.target.runner.TargetRunner`).
        cost: the verify policy's cost model.
        run_on_target: ``run_on_target(fn, *args, **kwargs)`` → awaitable of ``fn``'s result, run on the target's
            thread between batch steps (:meth:`cloud_verifier.batcher.Batcher.run_on_target`).
        busy: true while the verifier is not idle (work queued or in a forward pass; sessions held): a profile
            pass gives way.
        idle_s: seconds since the verifier last had work.
        pages_lock: held while profile passes take and give back KV pages (the session table's lock).
        cache: where tables are saved and read (None: neither; every start probes and profiles).
        key: what the table is for (:func:`~cloud_verifier.verify_policy.cost_table.target_key`).
        shapes: (rows, tokens per row) of the background profile.
        quiet_s: idle time before a profile pass, s.
    """

    def __init__(self, runner: Any, cost: ForwardCostModel, *, run_on_target: Callable[..., Awaitable],
                 busy: Callable[[], bool], idle_s: Callable[[], float], pages_lock: ContextManager | None = None,
                 cache: CostTableCache | None = None, key: dict | None = None,
                 shapes: tuple[tuple[int, int], ...] = PROFILE_SHAPES, quiet_s: float = QUIET_S):
        self.runner, self.cost, self.cache, self.key = runner, cost, cache, key
        self.shapes, self.quiet_s = tuple(shapes), float(quiet_s)
        self._run_on_target, self._busy, self._idle_s, self._pages_lock = run_on_target, busy, idle_s, pages_lock
        self.prior: str | None = None  # "saved" (a saved table), "probe" (one probe pass) or "none"
        self.points: list[tuple[int, int, float]] = []  # (rows, tokens, s) measured by the background profile
        self.saved_to = None  # the file the background profile's table was saved to, once saved
        self.done = asyncio.Event()  # set once the background profile has ended (or was not needed)
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._pass: asyncio.Future | None = None  # the latest profile pass sent to the target's thread

    async def start(self) -> None:
        """Give the model its prior (a saved table, or one probe pass on the target's thread), then start the
        background profile when there was no saved table. Call on the verifier's event loop, its batcher
        started."""
        points = None
        if self.cache is not None and self.key is not None:
            points = await asyncio.to_thread(self.cache.load, self.key)
        if points:
            for rows, tokens, seconds in points:
                self.cost.observe_profiled(rows, tokens, seconds)
            self.prior = "saved"
            self.done.set()
            log.info("cost model: the saved table (%d passes) of %s", len(points), self.cache.path_for(self.key))
            return
        rows, per_row = PROBE_SHAPE
        seconds = await self._measure(rows, per_row, repeats=1)
        if seconds is not None:
            self.cost.observe_profiled(rows, rows * per_row, seconds)
        self.prior = "probe" if seconds is not None else "none"
        self._task = asyncio.create_task(self._profile(), name="specdec-cost-profile")

    async def stop(self) -> None:
        """End the background profile; returns once no profile pass runs on the target's thread (one running ends
        at its next forward pass: the runner may serve another verifier next)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pass is not None:  # not cancelled with the task (shielded): it sees _stopping at once
            await asyncio.gather(self._pass, return_exceptions=True)
        self.done.set()

    def _should_stop(self) -> bool:
        return self._stopping or self._busy()

    async def _measure(self, rows: int, per_row: int, repeats: int = 2) -> float | None:
        self._pass = self._run_on_target(measure_shape, self.runner, rows, per_row, repeats,
                                         should_stop=self._should_stop, pages_lock=self._pages_lock)
        return await asyncio.shield(self._pass)

    async def _wait_quiet(self, poll_s: float = 0.1) -> None:
        """Until the verifier has been idle for ``quiet_s`` s: no work for that long (the batcher's clock) and not
        busy at any poll over that time (e.g. the last session closed ``quiet_s`` ago at least)."""
        quiet_since = None
        while True:
            now = time.monotonic()
            if self._busy():
                quiet_since = None
            else:
                quiet_since = now if quiet_since is None else quiet_since
                if min(now - quiet_since, self._idle_s()) >= self.quiet_s:
                    return
            await asyncio.sleep(poll_s)

    async def _profile(self) -> None:
        try:
            await self._measure_all()
            if self.points and self.cache is not None and self.key is not None:
                self.saved_to = await asyncio.to_thread(self.cache.save, self.key, self.points)
        except asyncio.CancelledError:
            raise
        except RuntimeError as e:  # the target thread was shut down under it (the process is ending)
            log.debug("background cost profile ended: %s", e)
        except Exception:  # noqa: BLE001 - the profile is an optimisation: serving goes on without it
            log.exception("background cost profile failed (live steps still refine the cost model)")
        finally:
            self.done.set()

    async def _measure_all(self) -> None:
        pool = self.runner.kv_pool
        start = time.monotonic()
        for rows, per_row in self.shapes:
            if rows * -(-per_row // pool.page_size) > pool.num_pages:
                continue  # never fits: live steps fill that part of the model
            short = 0  # times the pool had too few free pages for it (sessions hold them)
            while short < _MAX_TRIES:
                await self._wait_quiet()
                seconds = await self._measure(rows, per_row)
                if seconds is not None:
                    self.cost.observe_profiled(rows, rows * per_row, seconds)
                    self.points.append((rows, rows * per_row, seconds))
                    break
                short += 0 if self._should_stop() else 1  # giving way to work is no reason to leave it out
        log.info("cost model profiled in the background: %d of %d shapes in %.1f s (%s)", len(self.points),
                 len(self.shapes), time.monotonic() - start, self.cost.as_dict())
