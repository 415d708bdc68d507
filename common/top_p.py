"""The top-p step of :func:`common.logits.logits_to_probs`: exactly the kept set of the full-sort reference, found
by partial selection (:func:`top_p_keep`), with the reference's own sort (:func:`top_p_drop_reference`) only for
the rows where rounding decides.
"""

from __future__ import annotations

import threading

import numpy as np

# Top-p candidate search (see top_p_keep): the first partial selection takes this many of each row's most
# likely tokens, and each widening multiplies it by _TOP_P_WIDEN; a row still short of the kept mass once
# the candidates would pass half the vocabulary is sorted whole, as the reference does.
_TOP_P_FIRST_CANDIDATES = 64
_TOP_P_WIDEN = 8
_UNIT_ROUNDOFF = 2.0**-53  # float64 unit roundoff u



def top_p_keep(
    probs: np.ndarray,  # [n, vocab_size] float64, softmax output (rows sum to 1 up to rounding)
    top_p: float,
) -> np.ndarray:  # [n, vocab_size] bool: the tokens the reference's top-p step keeps
    """Exactly the reference's top-p kept set (see :func:`common.logits.logits_to_probs`), by partial selection.

    The reference drops the tokens at ascending-order positions j with ``cum[j] <= 1 - top_p``, where cum is
    the float64 running sum (np.cumsum, sequential) of the probabilities sorted ascending by (prob, id). As
    cum is non-decreasing, the dropped tokens are a prefix of that order and the kept ones the c' most likely
    tokens (most likely first, ties: higher id first) for some c' >= 1. Per row (all rows at once):

    1. Candidates (:func:`_top_candidates`, partial selection): the c most likely tokens of each row
       (c = 64 first), sorted ascending by (prob, id) with ``np.lexsort``: the reference's order restricted
       to them. Let v be the smallest candidate probability: every other token has prob <= v, and every
       token with prob > v is a candidate (of the tokens tied with v only some may be candidates, so only
       the candidates with prob > v are trusted). When a row has at most c tokens of positive probability
       (after top-k, or at near-greedy temperatures) the candidates are all of them ("complete"): the rest
       have probability 0, add nothing to any cum and are 0 in the output whether kept or not, so every
       candidate is decided by its est (step 2) and no selection is needed.
    2. In exact arithmetic the reference's cum at the candidate at sorted position j (prob > v) is
       est[j] = (row total - candidate total) + running sum of the sorted candidates up to j, and est at the
       last candidate equal to v is the mass of all tokens with prob <= v, which is the reference's cum at
       the last of them in its order (wherever the ties with v fall).
    3. The float sums differ from the reference's by rounding only: a sequential or pairwise float sum of m
       non-negative terms is within (m - 1)·u·(exact sum) of the exact sum (u = 2**-53; Higham, Accuracy and
       Stability of Numerical Algorithms, §4.2), and the rows sum to 1 within vocab_size·u, so
       |est[j] - cum[j]| < 3.1·vocab_size·u < tol = 8·(vocab_size + 16)·u (4.4e-11 for 49,152 tokens). A
       decision with est[j] <= 1 - top_p - tol (dropped) or est[j] > 1 - top_p + tol (kept) is therefore the
       reference's.
    4. If the mass of the tokens with prob <= v is definitely dropped, the kept set lies among the candidates
       with prob > v, each decided by its est (the most likely one is always kept, as in the reference). If
       that mass is definitely kept (the nucleus is wider than the candidates) or all candidates equal v, the
       row widens: c *= 8, a new selection. Once c would pass half the vocabulary, the row is decided by the
       reference's own full sort (:func:`top_p_drop_reference`).
    5. So is a row with a decision within tol of 1 - top_p (exact ties on the boundary: the reference's
       rounding decides), and a row whose probabilities are not finite.

    So the fast path departs from the reference only in the arithmetic that *locates* the boundary, never
    in the kept set, and hence not in the returned probabilities. Cost per row at 49,152 tokens: one
    partition of a copy of the row (about 0.05 ms) and a sort of 64 candidates for the nuclei of real LM
    logits (top_p 0.9 or 0.95 at temperature 0.7: 1-57 tokens), versus a full stable argsort (about 3 ms).
    """
    n, vocab = probs.shape
    thresh = 1.0 - top_p
    tol = 8.0 * (vocab + 16) * _UNIT_ROUNDOFF  # rows sum to 1 within vocab·u, so every cum is < 1.01
    bounds = (thresh - tol, thresh + tol)  # est <= lo: definitely dropped; est > hi: definitely kept
    keep = np.zeros((n, vocab), dtype=bool)
    total = probs.sum(axis=-1)  # [n]
    finite = np.isfinite(total)
    fallback = [np.flatnonzero(~finite)]  # row ids the reference decides
    pending = np.flatnonzero(finite)  # row ids still to decide
    c = min(vocab, _TOP_P_FIRST_CANDIDATES)
    while pending.size:
        if 2 * c > vocab:  # the candidates would be most of the row: sort it all, as the reference does
            fallback.append(pending)
            break
        unsure, widen = _top_p_round(probs, pending, total, c, bounds, keep)
        fallback.append(pending[unsure])
        pending = pending[widen]
        c *= _TOP_P_WIDEN
    rows = np.concatenate(fallback)
    if rows.size:
        keep[rows] = ~top_p_drop_reference(probs[rows], top_p)
    return keep


def _top_p_round(
    probs: np.ndarray,  # [n, vocab_size] float64, softmax output
    pending: np.ndarray,  # [m] int64: the rows still to decide
    total: np.ndarray,  # [n] float64: the row sums of probs
    c: int,  # candidates per row, 1 <= c <= vocab_size
    bounds: tuple[float, float],  # (lo, hi): est <= lo is definitely dropped, est > hi definitely kept
    keep: np.ndarray,  # [n, vocab_size] bool, written: the kept tokens of the rows this round decides
) -> tuple[np.ndarray, np.ndarray]:  # ([m] bool unsure, [m] bool widen) over pending
    """One selection round of :func:`top_p_keep` (its steps 1-5) over the rows ``pending``, with c candidates
    per row. Marks in ``keep`` the kept tokens of every row it decides; returns which rows are left to the
    reference's full sort (unsure) and which need more candidates (widen)."""
    lo, hi = bounds
    n = probs.shape[0]
    m = len(pending)
    r = np.arange(m)[:, None]
    idx, complete = _top_candidates(probs if m == n else probs[pending], c)  # [m, w] candidate ids
    w = idx.shape[1]
    vals = probs[pending[:, None], idx]  # [m, w]
    order = np.lexsort((idx, vals), axis=-1)  # ascending by (prob, id): the reference's stable order
    ids, vals = idx[r, order], vals[r, order]  # [m, w]
    est = np.cumsum(vals, axis=-1)  # [m, w]
    est += (total[pending] - est[:, -1])[:, None]  # + mass outside the candidates: the reference's cum ± tol
    pos = np.arange(w)
    if complete:  # every token of positive probability is a candidate: each is decided by its est
        jv = np.full(m, -1)
        widen, unsure = np.zeros(m, dtype=bool), np.zeros(m, dtype=bool)
    else:
        # jv: last sorted position tied with v = the smallest candidate (all non-candidates are <= v)
        jv = np.count_nonzero(vals == vals[:, :1], axis=-1) - 1  # [m]
        est_v = est[r[:, 0], jv]  # [m] mass of the tokens with prob <= v
        widen = (jv == w - 1) | (est_v > hi)  # the boundary is below the candidates (or all of them tie)
        unsure = ~widen & (est_v > lo)
    decided = pos > jv[:, None]  # [m, w] the candidates with prob > v, decided by est
    unsure |= (decided & (pos < w - 1) & (est > lo) & (est <= hi)).any(axis=-1)  # last one: always kept
    done = ~widen & ~unsure
    ri, ci = np.nonzero(((pos == w - 1) | (est > hi)) & decided & done[:, None])
    keep[pending[ri], ids[ri, ci]] = True
    return unsure, widen


_scratch = threading.local()  # per-thread reusable buffer of _top_candidates


def _negative_ramp(n: int) -> np.ndarray:  # [n] float64: -1, -2, ..., -n (read-only, cached per thread)
    ramp = getattr(_scratch, "ramp", None)
    if ramp is None or len(ramp) != n:
        ramp = _scratch.ramp = -np.arange(1, n + 1, dtype=np.float64)
        ramp.flags.writeable = False
    return ramp


def _top_candidates(
    probs: np.ndarray,  # [m, vocab_size] float64, non-negative, every row with a positive entry
    c: int,  # 1 <= c <= vocab_size
) -> tuple[np.ndarray, bool]:  # ([m, w] int64 token ids, complete)
    """Candidate ids for top-p: the c most likely tokens of each row, by partial selection (no sort).

    complete (w <= c): no row has more than c tokens of positive probability; the candidates are all of
    them (w = the largest count; a row with fewer is padded with one of its zero-probability ids, repeated).
    This is the case after top-k, and for near-greedy temperatures (exp underflow): no selection at all.

    Otherwise (w = c): the c largest keys of each row, the key being probs with each 0 replaced by -(1 + id).
    The zeros (top-k, -inf logits, padding, exp underflow) are thus not tied: equal keys by the thousand are
    introselect's slow case (~1 ms instead of 0.06 ms for a 49,152-token row). An in-place ``partition`` of
    the key gives the c-th largest key v of each row; the candidates are the ids with key > v and, of those
    with key == v (tied probabilities), the lowest ids. Unlike ``np.argpartition`` this allocates no
    [m, vocab_size] int64 result: the key lives in a per-thread buffer reused across calls (fresh arrays of
    that size cost more in page faults than the selection itself in a numpy-only process on this project's
    VM: ~0.5 ms per call measured).
    """
    m, vocab = probs.shape
    positive = probs > 0  # [m, vocab_size]
    num_positive = np.count_nonzero(positive, axis=-1)  # [m]
    if num_positive.max() <= c:
        w = int(num_positive.max())
        ri, ci = np.divmod(np.flatnonzero(positive), vocab)  # row-major: ids ascending within each row
        if (num_positive == w).all():
            return ci.reshape(m, w), True
        idx = np.repeat(np.argmin(positive, axis=-1)[:, None], w, axis=1)  # [m, w] a zero of each short row
        idx[ri, np.arange(len(ri)) - (np.cumsum(num_positive) - num_positive)[ri]] = ci
        return idx, True
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < probs.size:
        buf = _scratch.buf = np.empty(probs.size, dtype=np.float64)
    key = buf[: probs.size].reshape(m, vocab)  # [m, vocab_size]
    if num_positive.min() == vocab:  # no zeros: the key is probs
        np.copyto(key, probs)
    else:
        np.copyto(key, _negative_ramp(vocab))
        np.copyto(key, probs, where=positive)
    key.partition(vocab - c, axis=-1)
    v = key[:, vocab - c, None].copy()  # [m, 1] c-th largest key
    if (v > 0).all():  # the candidates are positive: key >= v <=> probs >= v
        ge = probs >= v
    else:  # the key again (the partition scrambled it)
        np.copyto(key, _negative_ramp(vocab))
        np.copyto(key, probs, where=positive)
        ge = key >= v
    ri, ci = np.divmod(np.flatnonzero(ge), vocab)  # row-major: ids ascending within each row; >= c per row
    if len(ri) == m * c:  # exactly c per row: no ties with v beyond the c-th
        return ci.reshape(m, c), False
    # ties with v (positive probabilities: the zeros' keys are distinct): all ids above it, the lowest tied ids
    above = np.where(positive[ri, ci], probs[ri, ci], -1.0 - ci) > v[ri, 0]  # key > v
    need = c - np.bincount(ri, weights=above, minlength=m).astype(np.int64)  # [m] ties to take
    tie = ~above
    tie_rank = np.cumsum(tie) - 1  # rank of each tie among all ties, then within its row
    tie_rank -= np.concatenate([[0], np.cumsum(np.bincount(ri, weights=tie, minlength=m).astype(np.int64))[:-1]])[ri]
    return ci[above | (tie & (tie_rank < need[ri]))].reshape(m, c), False


def top_p_drop_reference(
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
