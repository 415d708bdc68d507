"""Logits processing and counter-based randomness, shared by the draft (edge) and target (cloud) sides.

Both sides call :func:`logits_to_probs` with the same :class:`~common.types.SamplingParams`, so the draft
distribution (draft_probs, q) and the target distribution (target_probs, p) are processed identically
(temperature, then top-k, then top-p, as HF transformers' logits warpers order them).

Randomness is counter-based (Philox, Salmon et al. 2011, as in numpy/JAX/cuRAND): a draw is a pure
function of (seed, position, stream). A seeded session is therefore reproducible, independent of batching,
and a session resumed on another verifier replica makes the same draws.
"""

from __future__ import annotations

import enum

import numpy as np

from common.types import SamplingParams, SparseDraftProbs


class Stream(enum.IntEnum):
    """Independent random streams of one session (the Philox counter's second word)."""

    ACCEPT = 0  # verifier: acceptance test u < p(x)/q(x)
    TARGET_SAMPLE = 1  # verifier: recovered / bonus token, and target-only sampling
    DRAFT_SAMPLE = 2  # edge: sampling of draft tokens


_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int, stream: Stream) -> float:
    """One U[0, 1) draw for token ``position`` (absolute index in the sequence) of ``stream``.

    A pure function of its arguments (Philox-4x64 keyed by ``seed``; counter = (position, stream, 0, 0)).
    """
    bitgen = np.random.Philox(key=seed & _MASK64, counter=[position, int(stream), 0, 0])
    return float(np.random.Generator(bitgen).random())


# Top-p candidate search (see _top_p_keep): the first partial selection takes this many of each row's most
# likely tokens, and each widening multiplies it by _TOP_P_WIDEN; a row still short of the kept mass once
# the candidates would pass half the vocabulary takes the whole row (one sort of it, as the reference does).
_TOP_P_FIRST_CANDIDATES = 64
_TOP_P_WIDEN = 8
_UNIT_ROUNDOFF = 2.0**-53  # float64 unit roundoff u


def logits_to_probs(
    logits: np.ndarray,  # [n, vocab_size] (or [vocab_size]) float32/float64
    params: SamplingParams,
    valid_vocab_size: int | None = None,
) -> np.ndarray:  # [n, vocab_size] float64
    """Processed probabilities of each row: temperature, top-k, top-p, then softmax (float64).

    Semantics are those of HF transformers' TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper
    (applied in that order, as ``generate`` does), then softmax; at the boundaries:

    - top-k (``0 < top_k < vocab_size``): keeps every token whose scaled logit is >= the k-th largest one, so
      tokens tied with the k-th are all kept (more than k tokens survive a tie; HF does the same).
    - top-p (``top_p < 1``): sorts the top-k-processed probabilities ascending, ties in ascending token id
      (a stable sort), and drops every token whose ascending cumulative mass (float64, summed in that order)
      is ``<= 1 - top_p``; the last token of that order (the most likely; among equal ones the highest id) is
      always kept. Among tokens of equal probability straddling the boundary the LOWER ids are dropped first
      and the higher ids kept. The survivors are renormalised.

    Greedy params (temperature 0) give the one-hot distribution of the argmax (lowest id among ties).
    ``valid_vocab_size``: columns at or past it (padded embedding rows) get probability 0.
    A 1-D ``logits`` is one row: the result is [1, vocab_size]. The caller's array is never modified.

    This is the fast path; :func:`_logits_to_probs_reference` is the plain full-sort implementation it
    must equal. Results are bitwise identical to it (tests/common/test_sampling.py checks this): the
    temperature / top-k / softmax arithmetic is the reference's, element for element, and only the top-p
    selection differs in how it finds the kept set, with no full-vocabulary sort (see :func:`_top_p_keep`).
    Both the edge (one row per draft token) and the verifier (a [γ + 1, vocab_size] block) call this
    function, and a row's result does not depend on the other rows of the call.
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
    scaled = logits / params.temperature  # [n, vocab_size], a new array: the in-place steps below are safe
    if 0 < params.top_k < vocab:
        # k-th largest scaled logit of each row by partial selection (no sort); ties with it are kept
        kth = np.partition(scaled, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]
        np.copyto(scaled, -np.inf, where=scaled < kth)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled, out=scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        keep = _top_p_keep(probs, params.top_p)  # [n, vocab_size] bool
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _top_p_keep(
    probs: np.ndarray,  # [n, vocab_size] float64, softmax output (rows sum to 1 up to rounding)
    top_p: float,
) -> np.ndarray:  # [n, vocab_size] bool: the tokens the reference's top-p step keeps
    """Exactly the reference's top-p kept set (see :func:`logits_to_probs`), found by partial selection.

    The reference drops the tokens at ascending-order positions j with ``cum[j] <= 1 - top_p``, where cum is
    the float64 running sum (np.cumsum, sequential) of the probabilities sorted ascending by (prob, id). As
    cum is non-decreasing, the dropped tokens are a prefix of that order and the kept ones the c' most likely
    tokens for some c'. Per row (all rows at once, vectorized):

    1. Candidates: the c most likely tokens by ``np.argpartition`` (c = 64 first), sorted ascending by
       (prob, id) with ``np.lexsort`` (the reference's order restricted to them). Let v be the smallest
       candidate probability. Every other token has prob <= v, and every token with prob > v is a candidate.
    2. In exact arithmetic the reference's cum at candidate position j is
       est[j] = (row total - candidate total) + running sum of the sorted candidates up to j, and est at the
       last candidate equal to v is the mass of all tokens with prob <= v (wherever the ties with v fall).
    3. The float sums differ from the reference's by rounding only: a sequential or pairwise sum of m
       non-negative terms is within (m - 1)·u·(exact sum) of it (u = 2**-53, Higham, Accuracy and Stability
       of Numerical Algorithms, §4.2), so |est[j] - cum[j]| <= tol = 8·(vocab_size + 16)·u·max(1, total)
       (about 4e-11 for 49,152 tokens). A decision with est[j] <= 1 - top_p - tol (dropped) or
       est[j] > 1 - top_p + tol (kept) is the reference's.
    4. If the mass of the tokens with prob <= v is definitely dropped, the kept set lies among the candidates
       with prob > v and each of those is decided by est (the most likely one is always kept). If it is
       definitely kept (or all candidates equal v), the row needs more candidates: c *= 8. Once c would pass
       half the vocabulary the whole row is the candidate set (c = vocab_size, one sort of the row).
    5. A decision within tol of 1 - top_p (exact ties on the boundary, or a cumulative mass that the
       rounding of the reference's sum decides) is taken by the reference's own code on that row
       (:func:`_top_p_drop_reference`), as are rows whose probabilities are not finite.

    So the fast path departs from the reference only in arithmetic used to *locate* the boundary; the kept
    set, and hence the returned probabilities, are the reference's. Cost per row: one O(vocab) selection
    (about 0.05 ms at 49,152 tokens) plus a sort of the 64 candidates, versus a full stable argsort
    (about 3 ms) in the reference.
    """
    n, vocab = probs.shape
    thresh = 1.0 - top_p
    keep = np.zeros((n, vocab), dtype=bool)
    total = probs.sum(axis=-1)  # [n]
    finite = np.isfinite(total)
    tol = 8.0 * (vocab + 16) * _UNIT_ROUNDOFF * np.maximum(total, 1.0, where=finite, out=np.ones(n))  # [n]
    fallback = [np.flatnonzero(~finite)]  # row ids the reference decides
    pending = np.flatnonzero(finite)  # row ids still to decide
    c = min(vocab, _TOP_P_FIRST_CANDIDATES)
    while pending.size:
        if 2 * c > vocab:
            c = vocab
        sub = probs if pending.size == n else probs[pending]  # [m, vocab_size]
        m = len(pending)
        if c < vocab:
            idx = np.argpartition(sub, vocab - c, axis=-1)[:, vocab - c :]  # [m, c] the c most likely, unordered
        else:
            idx = np.broadcast_to(np.arange(vocab), (m, vocab))
        vals = np.take_along_axis(sub, idx, axis=-1)  # [m, c]
        order = np.lexsort((idx, vals), axis=-1)  # ascending by (prob, id): the reference's stable order
        ids = np.take_along_axis(idx, order, axis=-1)  # [m, c]
        vals = np.take_along_axis(vals, order, axis=-1)  # [m, c]
        rest = total[pending] - vals.sum(axis=-1)  # [m] mass outside the candidates
        est = rest[:, None] + np.cumsum(vals, axis=-1)  # [m, c] the reference's cum, up to tol
        lo = (thresh - tol[pending])[:, None]  # est <= lo: definitely dropped
        hi = (thresh + tol[pending])[:, None]  # est > hi: definitely kept
        pos = np.arange(c)
        if c < vocab:
            # jv: last sorted position tied with v = the smallest candidate (non-candidates are all <= v)
            jv = np.count_nonzero(vals == vals[:, :1], axis=-1) - 1  # [m]
            est_v = np.take_along_axis(est, jv[:, None], axis=-1)  # [m, 1] mass of tokens with prob <= v
            widen = (jv == c - 1) | (est_v[:, 0] > hi[:, 0])
            unsure = ~widen & (est_v[:, 0] > lo[:, 0])
        else:
            jv = np.full(m, -1)
            widen = unsure = np.zeros(m, dtype=bool)
        decide = (pos > jv[:, None]) & (pos < c - 1)  # [m, c] positions decided by est (last one: kept)
        unsure |= (decide & (est > lo) & (est <= hi)).any(axis=-1)
        done = ~widen & ~unsure
        kept = ((pos == c - 1) | (est > hi)) & (pos > jv[:, None]) & done[:, None]  # [m, c]
        rows = np.broadcast_to(pending[:, None], (m, c))
        keep[rows[kept], ids[kept]] = True
        fallback.append(pending[unsure])
        pending = pending[widen]
        c = min(vocab, c * _TOP_P_WIDEN)
    rows = np.concatenate(fallback)
    if rows.size:
        keep[rows] = ~_top_p_drop_reference(probs[rows], top_p)
    return keep


def _top_p_drop_reference(
    probs: np.ndarray,  # [n, vocab_size] float64
    top_p: float,
) -> np.ndarray:  # [n, vocab_size] bool: tokens top-p drops
    """The reference's top-p drop mask (full stable sort), used by the fast path for undecidable rows."""
    order = np.argsort(probs, axis=-1, kind="stable")  # ascending
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    cum = np.cumsum(sorted_probs, axis=-1)
    drop_sorted = cum <= (1.0 - top_p)
    drop_sorted[:, -1] = False
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return drop


def _logits_to_probs_reference(
    logits: np.ndarray,  # [n, vocab_size] float32
    params: SamplingParams,
    valid_vocab_size: int | None = None,
) -> np.ndarray:  # [n, vocab_size] float64
    """Reference for :func:`logits_to_probs` (same contract): the plain implementation with a full stable
    argsort for top-p: the implementation before the fast path, kept as the specification the fast path is
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
    probs = np.exp(scaled)
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
    return probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample of one token from a (possibly unnormalized) distribution ``probs`` [vocab_size].

    Deterministic in ``u`` (U[0,1)); never returns a token of probability 0.

    Raises:
        ValueError: if ``probs`` has no positive mass.
    """
    cum = np.cumsum(probs, dtype=np.float64)
    total = cum[-1]
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    idx = int(np.searchsorted(cum, u * total, side="right"))
    idx = min(idx, len(cum) - 1)
    while probs[idx] <= 0:  # guard against float edge cases at the top end
        idx -= 1
    return idx


def normalize_sparse(probs: np.ndarray) -> np.ndarray:
    """Float64 renormalisation of wire (float32) sparse probabilities [..., k]; both sides use it."""
    probs = np.asarray(probs, dtype=np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def topk_draft_distribution(
    probs: np.ndarray,  # [vocab_size] float64, processed draft probabilities of one position
    k: int,
) -> tuple[np.ndarray, np.ndarray]:  # ([k] int64 token ids, [k] float32 probs)
    """The sparse q of top-k drafting: the draft's k most likely tokens, renormalised.

    The draft must then sample from ``normalize_sparse(returned probs)`` so that q on the wire is exactly
    the distribution it sampled from. Zero-probability entries are dropped (k may shrink).
    """
    k = max(1, min(k, int(np.count_nonzero(probs > 0))))
    ids = np.argpartition(probs, len(probs) - k)[len(probs) - k :]
    ids = ids[np.argsort(-probs[ids], kind="stable")]
    top = probs[ids]
    return ids.astype(np.int64), (top / top.sum()).astype(np.float32)


def dense_draft_probs(
    draft_token_ids: list[int],  # [γ]
    draft_probs: SparseDraftProbs | None,
    position: int,
    vocab_size: int,
) -> np.ndarray:  # [vocab_size] float64
    """Dense q at block position ``position``: one-hot for greedy drafting, else the sparse top-k q."""
    q = np.zeros(vocab_size, dtype=np.float64)
    if draft_probs is None:
        q[draft_token_ids[position]] = 1.0
    else:
        q[draft_probs.token_ids[position]] = normalize_sparse(draft_probs.probs[position])
    return q
