"""The test and benchmark oracle of logits processing: :func:`logits_to_probs_reference`, the plain full-sort
implementation that the runtime's fast path (:func:`common.logits.logits_to_probs`) must equal bit for bit.

Used by the logits benchmark (:mod:`specdec.logits_bench`) and the tests (tests/common/test_sampling*.py); no
runtime code calls it.
"""

from __future__ import annotations

import numpy as np

from specdec_runtime.common.logits import exp64
from specdec_runtime.common.types import SamplingParams


def logits_to_probs_reference(
    logits: np.ndarray,  # [n, vocab_size] float32
    params: SamplingParams,
    valid_vocab_size: int | None = None,
) -> np.ndarray:  # [n, vocab_size] float64
    """Reference for :func:`common.logits.logits_to_probs` (same contract): the plain implementation with a
    full stable argsort for top-p: the implementation before the fast path, kept as the specification the fast path is
    tested against, bit for bit. One change: the input is made C-contiguous (``np.asarray`` kept a transposed
    input's layout, and the float64 row sums, hence the last bits of the probabilities, depended on it).
    """
    logits = np.ascontiguousarray(logits, dtype=np.float64)  # C order: row sums independent of the input's layout
    if logits.ndim == 1:
        logits = logits[None, :]
    if valid_vocab_size is not None and valid_vocab_size < logits.shape[-1]:
        logits = logits.copy()
        logits[:, valid_vocab_size:] = -np.inf
    n, vocab = logits.shape
    if params.greedy:
        probs = np.zeros_like(logits)
        probs[np.arange(n), np.argmax(logits, axis=-1)] = 1.0
        return probs
    scaled = logits / params.temperature
    if 0 < params.top_k < vocab:
        kth = np.partition(scaled, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled = scaled - scaled.max(axis=-1, keepdims=True)
    probs = exp64(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        # HF TopPLogitsWarper semantics: drop the tokens whose ascending cumulative mass is <= 1 - top_p,
        # always keeping the most likely one.
        order = np.argsort(probs, axis=-1, kind="stable")  # ascending
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        cum = np.cumsum(sorted_probs, axis=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[:, -1] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    if params.min_p > 0.0:  # HF MinPLogitsWarper: below min_p x the top probability dropped
        probs = np.where(probs < params.min_p * probs.max(axis=-1, keepdims=True), 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs
