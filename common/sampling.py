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
import threading

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
# the candidates would pass half the vocabulary is sorted whole, as the reference does.
_TOP_P_FIRST_CANDIDATES = 64
_TOP_P_WIDEN = 8
_UNIT_ROUNDOFF = 2.0**-53  # float64 unit roundoff u
_DRAFT_MAX_TIED = 4096  # draft_topk_distribution: more tokens tied at its k-th largest logit go the reference's way


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
      is ``<= 1 - top_p`` (a token that brings the mass exactly to 1 - top_p is dropped); the last token of
      that order (the most likely; among equal ones the highest id) is always kept (HF's
      min_tokens_to_keep=1). Among tokens of equal probability straddling the boundary the LOWER ids are
      dropped first and the higher ids kept. HF sorts with torch.sort, which leaves the order of ties
      unspecified; this tie rule is ours, and both sides apply it. The survivors are renormalised.

    Greedy params (temperature 0) give the one-hot distribution of the argmax (lowest id among ties).
    ``valid_vocab_size``: columns at or past it (padded embedding rows) get probability 0.
    A 1-D ``logits`` is one row: the result is [1, vocab_size]. The caller's array is never modified.

    This is the fast path; :func:`_logits_to_probs_reference` is the plain full-sort implementation it
    must equal, and its results are bitwise identical to it (tests/common/test_sampling.py checks this).
    Where it departs from the reference: the temperature / top-k / softmax arithmetic is the reference's,
    element for element, but done in place in one buffer (the top-k threshold by an in-place partition,
    then the buffer recomputed); the top-p kept set is found without a full-vocabulary sort
    (:func:`_top_p_keep`: partial selection, the reference's own sort only where rounding decides).
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
    probs = _exp64(scaled, out=scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        keep = _top_p_keep(probs, params.top_p)  # [n, vocab_size] bool
        np.copyto(probs, 0.0, where=np.logical_not(keep, out=keep))
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _exp64(
    x: np.ndarray,  # float64, any shape
    out: np.ndarray | None = None,  # float64, C-contiguous, same shape (may be x itself)
) -> np.ndarray:
    """exp element for element in float64, with torch's vectorised kernel (numpy's float64 exp is scalar libm
    on CPUs without AVX-512: about 0.5 ms for a 49,152-token row against 0.1 ms). Each value depends on its
    element only, not on the array's size, layout, offset or torch's thread count (tests/common/test_sampling.py
    checks it), so a row's probabilities do not depend on the rows around it; values are within an ulp of
    libm's. Both :func:`logits_to_probs` and its reference use it (they stay bit-identical)."""
    import torch

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


def _top_p_keep(
    probs: np.ndarray,  # [n, vocab_size] float64, softmax output (rows sum to 1 up to rounding)
    top_p: float,
) -> np.ndarray:  # [n, vocab_size] bool: the tokens the reference's top-p step keeps
    """Exactly the reference's top-p kept set (see :func:`logits_to_probs`), found by partial selection.

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
       reference's own full sort (:func:`_top_p_drop_reference`).
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
    lo, hi = thresh - tol, thresh + tol  # est <= lo: definitely dropped; est > hi: definitely kept
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
        fallback.append(pending[unsure])
        pending = pending[widen]
        c *= _TOP_P_WIDEN
    rows = np.concatenate(fallback)
    if rows.size:
        keep[rows] = ~_top_p_drop_reference(probs[rows], top_p)
    return keep


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
    probs = _exp64(scaled)
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
) -> tuple[np.ndarray, np.ndarray]:  # ([k'] int64 token ids, [k'] float32 probs), k' = min(k, tokens with p > 0)
    """The sparse q of top-k drafting: the draft's k most likely tokens, renormalised.

    The draft must then sample from ``normalize_sparse(returned probs)`` so that q on the wire is exactly
    the distribution it sampled from. Zero-probability entries are dropped (k may shrink).

    Ties: of the tokens tied with the k-th largest probability, the lowest ids are taken; the result is
    ordered most likely first, equal probabilities by ascending id (the first k of a stable descending sort).
    Only the edge runs this (the verifier gets ids and q on the wire), so the rule is for reproducibility,
    not for losslessness. No full-vocabulary sort: the k-th largest value comes from ``np.partition`` over
    the tokens of positive probability only (after top-k/top-p most of a row is 0, and tens of thousands of
    equal keys make introselect ~30x slower), then two comparison passes pick the ids.
    """
    probs = np.asarray(probs)
    positive = probs > 0  # [vocab_size]
    num_positive = int(np.count_nonzero(positive))
    if num_positive == 0:  # no mass: the argmax, with probability nan (as the full sort gave)
        ids = np.array([int(np.argmax(probs))], dtype=np.int64)
    else:
        cand = None if num_positive == len(probs) else np.flatnonzero(positive)  # [num_positive] ascending ids
        vals = probs if cand is None else probs[cand]  # [num_positive]
        k = max(1, min(k, num_positive))
        if k < num_positive:
            v = np.partition(vals, num_positive - k)[num_positive - k]  # k-th largest probability
            above = np.flatnonzero(vals > v)
            sel = np.concatenate([above, np.flatnonzero(vals == v)[: k - len(above)]])  # ties: lowest ids
        else:
            sel = np.arange(num_positive)
        sel = sel[np.lexsort((sel, -vals[sel]))]  # most likely first, ties by ascending id
        ids = (sel if cand is None else cand[sel]).astype(np.int64)
    top = probs[ids]
    return ids, (top / top.sum()).astype(np.float32)


def draft_topk_distribution(
    logits: np.ndarray,  # [vocab_size] float32, the draft's raw logits of one position
    params: SamplingParams,  # sampled (temperature > 0)
    k: int,  # top-k drafting's k, >= 1
    valid_vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # ([k'] int64 token ids, [k'] float32 probs), 1 <= k' <= k
    """The sparse q of top-k drafting straight from raw logits: what
    ``topk_draft_distribution(logits_to_probs(logits, params, valid_vocab_size)[0], k)`` gives, without a
    full-vocabulary probability row.

    Only the k most likely tokens of the processed distribution are needed, and top-p keeps a prefix of the
    tokens sorted most likely first (token j is kept iff the mass of the tokens before it is < top_p, the
    first always), so the k most likely tokens, their probabilities and the softmax normaliser decide it:
    one partial selection of the raw logits (the k largest; ties with the k-th: the lowest ids), one pass of
    exp over the row for the normaliser (float32, summed in float64; over the top-k-kept tokens when top-k is
    on), and a cumulative sum of k numbers. About 0.3 ms for 49,152 tokens against about 1 ms for the full
    row.

    Where it departs from the reference: the top-p decision at a candidate is taken on the descending
    cumulative sum of k float64 probabilities, the reference's on the ascending sum of the whole row, and the
    normaliser's exp is float32; they differ by rounding only, so the kept prefix can differ only when the
    mass of the tokens before a candidate is within ~1e-7 of top_p, and q's probabilities by ~1e-7. Either
    way q stays exactly the distribution the draft samples from (it samples from this q), which is all
    losslessness asks of the draft (:class:`edge_client.drafter.Drafter`); the verifier's target_probs keep
    the reference's exact semantics. Rows that are not finite, and greedy params, go through the reference.
    """
    logits = np.asarray(logits)
    if logits.ndim != 1:
        raise ValueError(f"logits must be one row [vocab_size], got shape {logits.shape}")
    row = logits[:valid_vocab_size] if valid_vocab_size is not None else logits
    n = len(row)
    k = max(1, min(int(k), n))
    m = float(row.max())
    if params.greedy or not np.isfinite(m):  # NaN anywhere makes the max NaN
        return _draft_q_by_full_row(logits, params, k, valid_vocab_size)
    # G: the tokens whose logit is >= the k-th largest, in the reference's top-p order (most likely first,
    # ties: highest id first); top-p keeps a prefix of that order, and q's k tokens are among G's kept ones
    v = np.partition(row, n - k)[n - k] if k < n else row.min()
    g = np.flatnonzero(row >= v)  # [>= k] ascending ids
    if len(g) > _DRAFT_MAX_TIED:  # thousands of equal logits: the reference's full row
        return _draft_q_by_full_row(logits, params, k, valid_vocab_size)
    g = g[np.lexsort((-g, -row[g]))]
    scaled_max = np.float64(m) / params.temperature  # the reference's row max of float64(logits) / temperature
    top = np.exp(row[g].astype(np.float64) / params.temperature - scaled_max)  # [len(g)] unnormalised
    scratch = np.empty(n, dtype=np.float64)
    np.divide(row, params.temperature, out=scratch, dtype=np.float64)  # the reference's scaled logits
    if 0 < params.top_k < n:  # top-k of the processed distribution: logits >= its k-th largest (ties kept)
        kth = np.partition(row, n - params.top_k)[n - params.top_k]
        top[row[g] < kth] = 0.0
        np.copyto(scratch, -np.inf, where=row < kth)
    scratch -= scaled_max
    # the normaliser: exp in float32 (vectorised; float64 exp is scalar libm on many CPUs, ~4x slower), summed
    # in float64: within ~1e-7 of the reference's, which only rounds q (the draft samples from the q it sends)
    z = float(np.exp(scratch.astype(np.float32), dtype=np.float32).sum(dtype=np.float64))
    probs = top / z  # [len(g)] processed probabilities before top-p
    keep = int(np.count_nonzero(probs > 0))  # positive ones first (most likely first)
    if params.top_p < 1.0:  # token j is kept iff the mass before it is < top_p (the first always)
        keep = min(keep, 1 + int(np.count_nonzero(np.cumsum(probs[:-1]) < params.top_p)))
    if keep == 0:  # everything underflowed: the reference's answer (the argmax)
        return _draft_q_by_full_row(logits, params, k, valid_vocab_size)
    kept_ids, kept = g[:keep], probs[:keep]
    order = np.lexsort((kept_ids, -kept))[:k]  # topk_draft_distribution's order: most likely, then lowest id
    ids, q = kept_ids[order].astype(np.int64), kept[order]
    total = q.sum()
    return ids, (q / total).astype(np.float32)


def _draft_q_by_full_row(
    logits: np.ndarray, params: SamplingParams, k: int, valid_vocab_size: int | None
) -> tuple[np.ndarray, np.ndarray]:  # ([k'] int64 ids, [k'] float32 probs)
    """draft_topk_distribution's fallback: the full processed row, then its top k."""
    return topk_draft_distribution(logits_to_probs(logits[None, :], params, valid_vocab_size)[0], k)


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
