"""Calibrating the draft's confidence against the acceptance the verifier measures.

A drafted token's probability under the draft (its confidence c: q(x) of a sampled token, the softmax maximum of
a greedy one) ranks positions well but is over-confident as a probability of acceptance: a small draft is sure of
tokens the target does not pick. :class:`AcceptanceCalibration` learns, online, α(c) = P(the rejection rule
accepts the token | the positions before it were accepted, its confidence is c) by histogram binning (Zadrozny &
Elkan 2001) on the verdicts themselves: every judged position is one Bernoulli observation of its bin. Positions
sent without a confidence (older edges, n-gram drafts) are binned by their index in the block instead (the
per-position acceptance of Leviathan et al. 2023, §3.4).

The calibration error reported is the expected calibration error (Naeini et al. 2015), over the observations so
far: Σ_b (n_b / N) · |mean prediction_b − acceptance_b|, of the raw confidence and of the calibrated estimate made
before each verdict.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

__all__ = ["AcceptanceCalibration", "CONFIDENCE_BIN_EDGES"]

CONFIDENCE_BIN_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)  # upper edges; last bin to 1
_PRIOR_COUNT = 4.0  # pseudo-observations per bin at its prior (the raw confidence; POSITION_PRIOR by index)
POSITION_PRIOR = 0.6  # prior acceptance of a position sent without a confidence
_MAX_COUNT = 2000.0  # a bin's counts are halved past it: the estimate follows a drifting workload


@dataclass
class _Bin:
    prior: float
    judged: float = 0.0
    accepted: float = 0.0
    sum_raw: float = 0.0  # raw confidences of the judged positions (ECE of the raw confidence)
    sum_predicted: float = 0.0  # calibrated estimates made before their verdicts (ECE of the estimate)
    total_judged: int = 0  # undecayed: the error is over every observation
    total_accepted: int = 0
    total_raw: float = 0.0
    total_predicted: float = 0.0

    def estimate(self) -> float:
        return (self.accepted + _PRIOR_COUNT * self.prior) / (self.judged + _PRIOR_COUNT)


class AcceptanceCalibration:
    """α(c): calibrated acceptance probability per confidence bin (or per block position without one).
    Thread-safe."""

    def __init__(self):
        edges = (*CONFIDENCE_BIN_EDGES, 1.0)
        lows = (0.0, *CONFIDENCE_BIN_EDGES)
        self._conf = [_Bin(prior=(lo + hi) / 2) for lo, hi in zip(lows, edges)]
        self._pos: list[_Bin] = []
        self._lock = threading.Lock()

    def _bin(self, confidence: float | None, position: int) -> _Bin:
        if confidence is None:
            while len(self._pos) <= position:
                self._pos.append(_Bin(prior=POSITION_PRIOR))
            return self._pos[position]
        return self._conf[bisect.bisect_left(CONFIDENCE_BIN_EDGES, float(confidence))]

    def estimate(self, confidence: float | None, position: int) -> float:
        """α of a draft token with this confidence (None: none sent) at 0-based ``position`` in its block."""
        with self._lock:
            return self._bin(confidence, position).estimate()

    def observe(self, confidences: list[float | None], predicted: list[float], num_judged: int,
                num_accepted: int) -> None:
        """One verdict: the block's first ``num_judged`` draft tokens went through the rejection rule and its first
        ``num_accepted`` were accepted (positions past the first rejection were not reached: not observed).

        ``confidences``/``predicted``: per draft token, its confidence (None: none) and the estimate the policy
        used for it before the verdict."""
        reached = min(num_judged, num_accepted + 1)
        with self._lock:
            for i in range(min(reached, len(confidences))):
                b = self._bin(confidences[i], i)
                ok = i < num_accepted
                raw = b.prior if confidences[i] is None else float(confidences[i])
                if b.judged >= _MAX_COUNT:
                    b.judged, b.accepted = b.judged / 2, b.accepted / 2
                b.judged += 1
                b.accepted += ok
                b.total_judged += 1
                b.total_accepted += ok
                b.total_raw += raw
                b.total_predicted += predicted[i] if i < len(predicted) else b.prior

    def calibration_error(self) -> dict[str, float | int]:
        """{"raw": ECE of the raw confidences, "calibrated": ECE of the estimates, "observations": N} (0.0 each
        before any observation)."""
        with self._lock:
            bins = [b for b in (*self._conf, *self._pos) if b.total_judged]
        n = sum(b.total_judged for b in bins)
        if not n:
            return {"raw": 0.0, "calibrated": 0.0, "observations": 0}

        def ece(attr: str) -> float:
            return sum(abs(getattr(b, attr) - b.total_accepted) for b in bins) / n  # Σ n_b·|mean_b − acc_b| / N

        return {"raw": round(ece("total_raw"), 4), "calibrated": round(ece("total_predicted"), 4), "observations": n}

    def table(self) -> list[dict[str, float]]:
        """Per confidence bin with observations: its upper edge, judged positions and acceptance (reports)."""
        edges = (*CONFIDENCE_BIN_EDGES, 1.0)
        with self._lock:
            return [{"confidence_le": e, "judged": b.total_judged, "estimate": round(b.estimate(), 4),
                     "acceptance": round(b.total_accepted / b.total_judged, 4)}
                    for e, b in zip(edges, self._conf) if b.total_judged]
