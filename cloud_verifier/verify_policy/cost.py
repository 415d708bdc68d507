"""The cost model of adaptive verification: the target's forward time as a function of the rows and the tokens in
the pass.

    forward_s ≈ base + per_row · rows + per_token · tokens

fitted by least squares with exponential forgetting (recursive least squares, weight ``FORGET`` per live step)
over the passes the target ran, with non-negative coefficients. The rows term carries what a row costs whatever
its length — its attention over its context, which grows as sessions get longer, and per-row overheads — so the
per-token term is the marginal cost of verifying one more position of a row, the only one the verify policy
trades. A table of tokens alone mixes the two: at 64 sessions of 500-token contexts it read 3.3 s for a step of
512 tokens and 0.7 s for one of 290 measured at start-up, and the policy cut blocks whose cut saved far less.

Where its data comes from: a prior when the verifier starts (the last profile saved for this target and device,
:mod:`~cloud_verifier.verify_policy.cost_table`, or one probe pass), a profile of several shapes measured in the
background while the verifier is idle (:mod:`~cloud_verifier.verify_policy.profiler`, one pass at a time through
:func:`measure_shape`: several shapes, so rows and tokens are not collinear), and every live step
(:meth:`ForwardCostModel.observe`), so it follows load, context lengths and the hardware. On a CPU the per-token
term is large from the first token; on a GPU it is near zero until the batch fills the device: the model holds
whatever the target measures.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, ContextManager

import numpy as np

__all__ = ["FORGET", "PROFILE_SHAPES", "PROFILE_WEIGHT", "ForwardCostModel", "measure_shape", "profile_forward"]

# (rows, tokens per row) of the profiled passes: short and long rows, few and many
PROFILE_SHAPES = ((1, 1), (1, 8), (1, 64), (8, 8), (8, 32), (32, 8), (16, 32), (64, 8))
FORGET = 0.98  # weight of the past at each live step (an effective memory of ~50 steps)
PROFILE_WEIGHT = 5.0  # a profiled pass counts as this many live steps (it anchors the split rows/tokens)


class ForwardCostModel:
    """forward_s ≈ base + per_row · rows + per_token · tokens (this module's docstring). Thread-safe."""

    def __init__(self):
        self._gram = np.zeros((3, 3))  # Σ w x xᵀ, x = [1, rows, tokens]
        self._moment = np.zeros(3)  # Σ w x y
        self._count = 0
        self._coef = np.zeros(3)
        self._rows_seen: set[int] = set()
        self._tokens_seen: set[int] = set()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        """Whether the fit can be trusted: passes of at least two row counts and two token counts. Before that
        the base and the per-row cost are not separable (a one-session server's steps all have one row, and two
        passes of one row fit a line through noise), so the policy verifies whole blocks until a saved table, the
        background profile or steps of several sessions have spanned both."""
        return self._count >= 2 and len(self._rows_seen) >= 2 and len(self._tokens_seen) >= 2

    def observe(self, rows: int, tokens: int, seconds: float, weight: float = 1.0, forget: float = FORGET) -> None:
        """A forward pass of ``rows`` rows and ``tokens`` tokens took ``seconds`` s (past observations weigh
        ``forget`` times less afterwards)."""
        if rows < 1 or tokens < 1 or not seconds > 0:
            return
        x = np.array([1.0, float(rows), float(tokens)])
        with self._lock:
            self._gram = forget * self._gram + weight * np.outer(x, x)
            self._moment = forget * self._moment + weight * x * seconds
            self._count += 1
            self._rows_seen.add(int(rows))
            self._tokens_seen.add(int(tokens))
            self._coef = _nonnegative_fit(self._gram, self._moment)

    def observe_profiled(self, rows: int, tokens: int, seconds: float) -> None:
        """A profiled pass (measured apart from live steps, or read from a saved table): weighs
        :data:`PROFILE_WEIGHT` live steps and never fades (it anchors the split of rows and tokens)."""
        self.observe(rows, tokens, seconds, weight=PROFILE_WEIGHT, forget=1.0)

    @property
    def num_observations(self) -> int:
        """Passes observed so far (profiled and live)."""
        with self._lock:
            return self._count

    def coefficients(self) -> dict[str, float]:
        """{"base": s, "per_row": s, "per_token": s} (zeros before two observations)."""
        with self._lock:
            c = self._coef.copy() if self._count >= 2 else np.zeros(3)
        return {"base": float(c[0]), "per_row": float(c[1]), "per_token": float(c[2])}

    def cost_s(self, rows: int, tokens: float) -> float:
        """Expected forward seconds of a pass of ``rows`` rows and ``tokens`` tokens (0.0 before two passes)."""
        c = self.coefficients()
        return c["base"] + c["per_row"] * rows + c["per_token"] * tokens

    def as_dict(self) -> dict[str, float]:
        """The coefficients, s, rounded (metrics and benchmark reports)."""
        return {k: round(v, 7) for k, v in self.coefficients().items()}


def _nonnegative_fit(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients over 3 terms (all subsets of the terms tried: the best
    feasible one), ridge-regularised so collinear data (every live step the same shape) stays solvable."""
    ridge = 1e-9 * max(1.0, float(np.trace(gram)))
    best, best_loss = np.zeros(3), float("inf")
    for mask in range(1, 8):
        idx = [i for i in range(3) if mask >> i & 1]
        g = gram[np.ix_(idx, idx)] + ridge * np.eye(len(idx))
        try:
            sol = np.linalg.solve(g, moment[idx])
        except np.linalg.LinAlgError:
            continue
        if (sol < 0).any():
            continue
        coef = np.zeros(3)
        coef[idx] = sol
        loss = float(coef @ gram @ coef - 2 * coef @ moment)  # Σ w (y − x·c)² up to a constant
        if loss < best_loss:
            best, best_loss = coef, loss
    return best


def measure_shape(runner: Any, rows: int, per_row: int, repeats: int = 2, *,
                  should_stop: Callable[[], bool] | None = None,
                  pages_lock: ContextManager | None = None) -> float | None:
    """The forward time, s, of ``runner`` (a :class:`cloud_verifier.target.runner.TargetRunner`) for one pass of
    ``rows`` rows of ``per_row`` tokens: one warm-up pass, then the median of ``repeats``. Runs forward passes:
    call it on the target's thread.

    None when the shape was not measured: the KV pool has too few free pages for it (it never evicts a cached
    page nor takes one a session may need next), or ``should_stop()`` turned true between two passes (real work
    is waiting: the measure gives way). ``pages_lock``: held while KV pages are taken and given back (the session
    table's lock, when sessions may be open); never during a forward pass."""
    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    page = runner.kv_pool.page_size
    ids = [(7919 * i + 11) % max(1, min(runner.vocab_size, 32000)) for i in range(per_row)]
    lock = pages_lock if pages_lock is not None else contextlib.nullcontext()
    kvs = []
    try:
        with lock:
            if runner.kv_pool.pages.num_free < rows * -(-per_row // page):
                return None
            for _ in range(rows):
                kvs.append(runner.allocate(per_row))
        batch = [ForwardRow(kv, ids, 0, "all") for kv in kvs]
        times = []
        for i in range(1 + max(1, repeats)):  # the first pass is a warm-up: allocator growth, first-call costs
            if should_stop is not None and should_stop():
                return None
            t0 = time.perf_counter()
            runner.forward(batch)
            if i:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    except Exception:  # noqa: BLE001 - the pool cannot hold this pass after all: not measured
        return None
    finally:
        with lock:
            for kv in kvs:
                runner.free(kv)


def profile_forward(runner: Any, model: ForwardCostModel, shapes=PROFILE_SHAPES, repeats: int = 2) -> None:
    """Fill ``model`` with the forward time of ``runner`` for passes of each of ``shapes`` ((rows, tokens per
    row)), at once (:func:`measure_shape`; shapes the KV pool cannot hold are left out: live steps fill the
    model). Runs forward passes: call it on the target's thread, while no session is open (benchmarks; a
    verifier profiles in the background: :mod:`~cloud_verifier.verify_policy.profiler`)."""
    for rows, per_row in shapes:
        seconds = measure_shape(runner, rows, per_row, repeats)
        if seconds is not None:
            model.observe_profiled(rows, rows * per_row, seconds)
