"""The cost table of adaptive verification: the target's forward time as a function of the tokens in the pass.

Profiled at start-up (:func:`profile_forward`: a few ragged forward passes of rows of
:data:`PROFILE_ROW_TOKENS` tokens), then refreshed from every live step (:meth:`ForwardCostTable.observe`, an
exponential moving average per bucket), so it follows load, context lengths and the hardware it runs on. On a CPU
the forward time grows with the tokens from the first one; on a GPU it stays flat until the batch fills the
device, then grows: the table holds whatever the target measures, no model of either is assumed.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

__all__ = ["ForwardCostTable", "PROFILE_TOKENS", "PROFILE_ROW_TOKENS", "profile_forward"]

PROFILE_TOKENS = (1, 8, 32, 128, 512)  # tokens per profiled forward pass (capped by the KV pool)
PROFILE_ROW_TOKENS = 8  # tokens per row of a profiled pass (a verify row of γ = 7: the usual shape)


class ForwardCostTable:
    """Forward seconds per tokens in the pass: buckets at powers of two, each the moving average of the (tokens,
    seconds) of the passes that fell in it, read by piecewise-linear interpolation (linear extrapolation past the
    last bucket; never decreasing in tokens). Thread-safe (the batcher writes it in the target thread, metrics read
    it elsewhere).

    Args:
        ema: weight of a new observation in its bucket (0 < ema <= 1).
    """

    def __init__(self, ema: float = 0.2):
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        self.ema = ema
        self._buckets: dict[int, list[float]] = {}  # log2 bucket -> [mean tokens, mean seconds]
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._buckets)

    def observe(self, tokens: int, seconds: float) -> None:
        """One forward pass of ``tokens`` tokens that took ``seconds`` s."""
        if tokens < 1 or not seconds > 0:
            return
        b = round(math.log2(tokens))
        with self._lock:
            point = self._buckets.get(b)
            if point is None:
                self._buckets[b] = [float(tokens), float(seconds)]
            else:
                point[0] += self.ema * (tokens - point[0])
                point[1] += self.ema * (seconds - point[1])

    def points(self) -> list[tuple[float, float]]:
        """(tokens, seconds) per bucket, by tokens, seconds made non-decreasing (a noisy bucket cannot make more
        tokens look cheaper)."""
        with self._lock:
            pts = sorted((t, s) for t, s in self._buckets.values())
        out, top = [], 0.0
        for t, s in pts:
            top = max(top, s)
            out.append((t, top))
        return out

    def cost_s(self, tokens: float) -> float:
        """Forward seconds of a pass of ``tokens`` tokens (0.0 when nothing was measured yet)."""
        pts = self.points()
        if not pts:
            return 0.0
        if len(pts) == 1 or tokens <= pts[0][0]:
            t0, s0 = pts[0]
            return s0 * (tokens / t0 if len(pts) == 1 and tokens > t0 else 1.0)
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / max(t1 - t0, 1e-9)
        (t0, s0), (t1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / max(t1 - t0, 1e-9)) * (tokens - t1)

    def as_dict(self) -> dict[str, float]:
        """{"tokens": seconds} per bucket (metrics and benchmark reports), tokens rounded."""
        return {str(round(t)): round(s, 6) for t, s in self.points()}


def profile_forward(runner: Any, table: ForwardCostTable, token_counts=PROFILE_TOKENS, repeats: int = 2) -> None:
    """Fill ``table`` with the forward time of ``runner`` (a :class:`cloud_verifier.target.TargetRunner`) for
    passes of each of ``token_counts`` tokens, in rows of :data:`PROFILE_ROW_TOKENS` tokens (one warm-up pass,
    then the median of ``repeats``). Counts the KV pool cannot hold at once are left out (live steps fill them).
    Runs forward passes: call it on the target's thread, before sessions open."""
    from cloud_verifier.forward_row import ForwardRow

    ids = [(7919 * i + 11) % max(1, min(runner.vocab_size, 32000)) for i in range(PROFILE_ROW_TOKENS)]
    for total in token_counts:
        sizes = [PROFILE_ROW_TOKENS] * (total // PROFILE_ROW_TOKENS) + ([total % PROFILE_ROW_TOKENS] if
                                                                     total % PROFILE_ROW_TOKENS else [])
        kvs = []
        try:
            for n in sizes:
                kvs.append(runner.allocate(n))
        except Exception:  # noqa: BLE001 - the pool is too small for this pass: stop profiling here
            for kv in kvs:
                runner.free(kv)
            return
        try:
            rows = [ForwardRow(kv, ids[:n], 0, "all") for kv, n in zip(kvs, sizes)]
            runner.forward(rows)  # warm-up: allocator growth, first-call costs
            times = []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                runner.forward(rows)
                times.append(time.perf_counter() - t0)
            table.observe(total, sorted(times)[len(times) // 2])
        finally:
            for kv in kvs:
                runner.free(kv)
