"""Logits processing: temperature → top-k → top-p → softmax → min-p (:func:`logits_to_probs`), identical on the
draft (edge) and target (cloud) sides, so draft_probs (q) and target_probs (p) are processed alike. Exported by
:mod:`common.sampling` as well. The history-dependent processors (logit_bias, penalties, min_tokens) run before
it, per position: :mod:`common.logits_processors`.
"""

from __future__ import annotations

import functools

import numpy as np

from specdec_runtime.common.top_p import top_p_keep
from specdec_runtime.common.types import SamplingParams


def logits_to_probs(
    logits: np.ndarray,  # [n, vocab_size] (or [vocab_size]) float32/float64
    params: SamplingParams,
    valid_vocab_size: int | None = None,
) -> np.ndarray:  # [n, vocab_size] float64
    """Processed probabilities of each row: temperature, top-k, top-p, softmax, then min-p (float64).

    Semantics are those of HF transformers' TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper
    (applied in that order, as ``generate`` does), then softmax; at the boundaries:

    - top-k (``0 < top_k < vocab_size``): keeps every token whose scaled logit is >= the k-th largest one, so
      tokens tied with the k-th are all kept (more than k tokens survive a tie; HF does the same).
    - top-p (``top_p < 1``): sorts the top-k-processed probabilities ascending, ties in ascending token id
      (a stable sort), and drops every token whose ascending cumulative mass (float64, summed in that order)
      is ``<= 1 - top_p`` (a token that brings the mass exactly to 1 - top_p is dropped); the last token of
      that order (the most likely; among equal ones the highest id) is always kept (HF's
      min_tokens_to_keep=1). Among tokens of equal probability straddling the boundary the LOWER ids are
      dropped first and the higher ids kept. HF sorts with torch.sort, which leaves the order of ties
      unspecified; this tie rule is ours, and both sides apply it. The survivors are renormalised.
      ``top_p == 0`` keeps only that last token (the most likely).
    - min-p (``min_p > 0``): :func:`apply_min_p` on the renormalised rows (tokens below min_p x the top
      probability dropped, renormalised again).

    Greedy params (temperature 0) give the one-hot distribution of the argmax (lowest id among ties).
    ``valid_vocab_size``: columns at or past it (padded embedding rows) get probability 0.
    A 1-D ``logits`` is one row: the result is [1, vocab_size]. The caller's array is never modified.

    This is the fast path; ``specdec.logits_reference.logits_to_probs_reference`` is the plain full-sort
    implementation it must equal, and its results are bitwise identical to it (tests/common/test_sampling.py
    checks this).
    Where it departs from the reference: the temperature / top-k / softmax arithmetic is the reference's,
    element for element, but done in place in one buffer (the top-k threshold by an in-place partition,
    then the buffer recomputed); the top-p kept set is found without a full-vocabulary sort
    (:func:`common.top_p.top_p_keep`: partial selection, the reference's own sort only where rounding decides).
    Both the edge (one row per draft token) and the verifier (a [γ + 1, vocab_size] block) call this
    function, and a row's result does not depend on the other rows of the call, nor on the input's layout.
    """
    logits = np.asarray(logits)
    if logits.ndim == 1:
        logits = logits[None, :]
    n, vocab = logits.shape
    masked = valid_vocab_size is not None and valid_vocab_size < vocab
    if params.greedy:
        probs = np.zeros((n, vocab), dtype=np.float64)
        probs[np.arange(n), np.argmax(logits[:, :valid_vocab_size] if masked else logits, axis=-1)] = 1.0
        return probs
    # One new C-order float64 buffer, processed in place from here on (the reference's arithmetic, without its
    # temporaries): float64(logits) / temperature, as the reference computes it.
    scaled = np.empty((n, vocab), dtype=np.float64)  # [n, vocab_size]
    _scale(logits, params.temperature, valid_vocab_size if masked else None, out=scaled)
    if 0 < params.top_k < vocab:
        # k-th largest scaled logit of each row by partial selection (no sort), in place, then the buffer is
        # recomputed (cheaper than a copy of it); tokens below it are dropped, ties with it kept
        scaled.partition(vocab - params.top_k, axis=-1)
        kth = scaled[:, vocab - params.top_k, None].copy()  # [n, 1]
        _scale(logits, params.temperature, valid_vocab_size if masked else None, out=scaled)
        np.copyto(scaled, -np.inf, where=scaled < kth)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = exp64(scaled, out=scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        keep = top_p_keep(probs, params.top_p)  # [n, vocab_size] bool
        np.copyto(probs, 0.0, where=np.logical_not(keep, out=keep))
        probs /= probs.sum(axis=-1, keepdims=True)
    if params.min_p > 0.0:
        apply_min_p(probs, params.min_p)
    return probs


def apply_min_p(
    probs: np.ndarray,  # [n, vocab_size] float64, normalised rows, modified in place
    min_p: float,  # in (0, 1]
) -> np.ndarray:
    """min-p sampling (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"; HF MinPLogitsWarper): drop the
    tokens whose probability is below ``min_p`` x the row's top probability (the top one is always kept), then
    renormalise. The threshold is relative, so renormalising first (after top-p) changes nothing but rounding;
    the reference applies the same two lines."""
    np.copyto(probs, 0.0, where=probs < min_p * probs.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


@functools.lru_cache(maxsize=1)
def _torch():
    """torch when it is installed (the verifier, a full install), else None: looked up once per process."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def exp64(
    x: np.ndarray,  # float64, any shape
    out: np.ndarray | None = None,  # float64, C-contiguous, same shape (may be x itself)
) -> np.ndarray:
    """exp element for element in float64, with torch's vectorised kernel (numpy's float64 exp is scalar libm
    on CPUs without AVX-512: about 0.5 ms for a 49,152-token row against 0.1 ms). Each value depends on its
    element only, not on the array's size, layout, offset or torch's thread count (tests/common/test_sampling.py
    checks it), so a row's probabilities do not depend on the rows around it; values are within an ulp of
    libm's. Both :func:`logits_to_probs` and its reference use it (they stay bit-identical).

    Without torch (an edge install, ``specdec-edgecloud[edge]``) numpy's exp, also element for element: the draft's q only
    has to be the distribution the draft sampled from, never bit-identical to the verifier's p."""
    torch = _torch()
    if torch is None:
        return np.exp(x, out=out) if out is not None else np.exp(np.asarray(x, dtype=np.float64))
    src = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    if out is None:
        return torch.exp(src).numpy()
    torch.exp(src, out=torch.from_numpy(out))
    return out


def _scale(
    logits: np.ndarray,  # [n, vocab_size] any real dtype, any layout
    temperature: float,
    valid_vocab_size: int | None,
    out: np.ndarray,  # [n, vocab_size] float64, written
) -> None:
    """out = float64(logits) / temperature, with columns at or past valid_vocab_size = -inf / temperature
    (the reference's order: it masks the float64 logits, then divides)."""
    np.divide(logits, temperature, out=out, dtype=np.float64)
    if valid_vocab_size is not None:
        out[:, valid_vocab_size:] = -np.inf / temperature
